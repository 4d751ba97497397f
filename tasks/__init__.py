"""Thin Prefect @task wrappers around nightloom: retries where I/O is, caching, artifacts, logging."""
