"""What a run reports and to whom: its metrics (metrics.jsonl and the trackers of log.report_to, registered in
trackers/), its progress lines (tracking.py) and its plot (plotting.py). The run writes here; `podsrl report`, the plots and the benchmarks
read the metrics back."""
