"""`python -m podsrl ...` (also what `torchrun -m podsrl train ...` runs)."""

from podsrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
