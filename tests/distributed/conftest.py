"""Session fixtures for trainer tests: one corpus and one single-process reference run per session."""

from __future__ import annotations

import pytest

from tests.support.harness import REF_PLAN, STEPS, launch, make_job, write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def reference(corpus, tmp_path_factory):
    """Losses of the uninterrupted single-process run (5 AdamW steps, checkpoint at step 3)."""
    job = make_job(
        tmp_path_factory.mktemp("ref") / "run", corpus, steps=STEPS, train_kw={"checkpoint_every": 3}, **REF_PLAN
    )
    out = launch(1, job, timeout=180)
    assert len(out.losses) == STEPS, out.output[-3000:]
    return out
