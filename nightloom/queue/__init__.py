"""The night queue: many runs packed onto one cluster's nodes across off-peak nights, by priority and deadline.

Its modules, one job each: `jobs` (the queue's one job record, QueuedJob, its figures from a spec and the rules
that refuse a job), `timetable` (the plan: jobs packed onto disjoint node subsets across nights, pure and
deterministic), `tonight` (one night of it: what is left of each job, tonight's stretches, what a night makes of a
job, each stretch's placement), `gantt` (the plan's chart) and `store` (the queues, their jobs and their nights in
the ledger's database). Import from the module that owns a name: this re-exports nothing.
"""
