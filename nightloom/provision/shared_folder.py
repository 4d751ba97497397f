"""Is the run folder on the orchestrator the same folder on every node?

Node 0 writes the run's metrics, logs, checkpoints and (XTuner) processed data and model into the run folder and
the ranks read their shards from it, so nodes that do not share it (a mount at the same path) would fail mid-run
on a missing file, or finish with the results on a node's own disk. This check refuses them right after
acquire, before training, naming each node and what it saw. Nothing is fetched back: a multi-node run needs the
run folder shared (NFS, Lustre, a cluster filesystem); sharded data and models may come from s3:// instead.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from nightloom.provision.base import REMOTE_PROVIDERS, Cluster, NodeShell, ProvisionError

# The node prints the token it reads from the probe file; its own interpreter, so no shell quoting is involved.
_READ = "import sys\nwith open(sys.argv[1], encoding='utf-8') as f:\n    print(f.read().strip())"


def check_shared_folder(shell: NodeShell, cluster: Cluster, folder: Path, field: str = "storage.root") -> None:
    """Write a one-time token into `folder`, have every node of `cluster` read it back through `shell.run_on`;
    ProvisionError (and only that) naming every node that cannot (with its error), cannot be asked (unreachable,
    timed out) or reads another file. The probe is removed. Nodes on this machine (local) are not asked."""
    if cluster.provider not in REMOTE_PROVIDERS:
        return
    token = secrets.token_hex(8)
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".nightloom-shared-{token}"
    probe.write_text(token, encoding="utf-8")
    bad: list[str] = []
    try:
        for node in cluster.nodes:
            try:
                r = shell.run_on(cluster, node, [node.python, "-c", _READ, str(probe)], {}, timeout_s=120)
            except Exception as e:  # noqa: BLE001 - unreachable or timed out: this node is named, the rest checked
                bad.append(f"{node.name} ({type(e).__name__}: {str(e)[:200]})")
                continue
            lines = [x.strip() for x in r.output.splitlines()]  # stderr notices (srun, warnings) may follow
            if r.code != 0 or token not in lines:
                why = next((x for x in reversed(lines) if x), f"exit {r.code}, no output")
                bad.append(f"{node.name} ({why[:200]})")
    finally:
        probe.unlink(missing_ok=True)
    if bad:
        raise ProvisionError(
            f"{field}: the run folder {folder} is not the same folder on node(s) {', '.join(bad)}; a run on "
            f"{cluster.provider} nodes writes its metrics, logs and checkpoints there from node 0: mount it at "
            "the same path on every node (NFS, Lustre, ...) or set storage.root to a folder they share"
        )
