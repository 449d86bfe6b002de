"""Planning a run before it starts: `podsrl plan --memory` (the memory model, its workload and report) and
`podsrl plan` (step costs measured on this machine, candidate settings)."""
