"""Streams each test phase's duration to $DURLOG as it finishes (a run cut short still leaves its times)."""
import os, time

def pytest_runtest_logreport(report):
    path = os.environ.get("DURLOG")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\t{time.time():.0f}\n")
