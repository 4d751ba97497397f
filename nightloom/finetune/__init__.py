"""XTuner as a fine-tuning backend: its own node env, rendered configs, a wrapper launch, metrics and conversion.

Pure logic like the rest of nightloom (no Prefect). xtuner itself is never imported here: it lives in the
env built by `env.ensure_env` and runs through `node_wrapper.py`. Entry point: `run.run_xtuner`; its steps are
`plan` (check and render), `run.prepare_data`, `attempts` (train under nightloom.recovery's rule) and
`convert`. The package imports nothing, so each module loads only what it needs: import from the modules.
"""
