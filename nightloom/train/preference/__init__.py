"""Preference tuning (train.task dpo): pairwise losses, per-sequence log-probs of chosen and rejected completions
in one forward, the reference's log-probs and the metrics under TRL's names. Pure torch; the trainer calls it."""
