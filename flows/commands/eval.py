"""`nightloom eval RUN_DIR --data FILE.jsonl [--seq-len N] [--json]`: held-out loss of a run's latest checkpoint."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("eval", help="score a run's latest checkpoint on a JSONL file (mean NLL per token, ppl)")
    p.add_argument("run_dir", help="the run folder (holds job*.json and checkpoints/)")
    p.add_argument(
        "--data",
        required=True,
        help="JSONL file of documents ({'text': ...} per line); for a train.task sft run, chat records (messages, "
        "conversations or instruction/output), scored on their assistant tokens only",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per document scored (default: the run's)")
    p.add_argument("--json", action="store_true", help="print {loss, tokens, ppl, ...} as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from nightloom.tokenizer import TokenizerError
    from nightloom.train.evaluate import EvalError, evaluate_run

    if args.seq_len is not None and args.seq_len < 2:
        print("nightloom eval: error: --seq-len must be >= 2", file=sys.stderr)
        return 2
    try:
        r = evaluate_run(args.run_dir, args.data, args.seq_len)
    except (EvalError, TokenizerError, OSError) as e:
        print(f"nightloom eval: failed: {e}", file=sys.stderr)
        return 1
    if args.json:
        out = {"loss": r.loss, "tokens": r.tokens, "ppl": r.ppl, "documents": r.documents, "step": r.step}
        sft = {"task": r.task, "dropped": r.dropped} if r.task == "sft" else {}
        print(json.dumps(out | sft | {"checkpoint": r.checkpoint}, indent=2))
    else:
        what = "assistant tokens" if r.task == "sft" else "predicted tokens"
        print(
            f"{args.run_dir}: step {r.step}: loss {r.loss:.6f} ppl {r.ppl:.3f} over {r.tokens:,} {what} "
            f"in {r.documents} documents" + (f" ({r.dropped} too long, dropped)" if r.dropped else "")
        )
    return 0
