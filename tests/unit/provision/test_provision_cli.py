"""`nightloom provision SPEC --check`: local provider end to end, and a bad spec."""

import json

from flows.cli import main


def test_check_local_json(tmp_path, capsys):
    from nightloom.provision.local import free_port

    spec = tmp_path / "spec.yaml"
    # its own rendezvous port: the default 29500 may be held by another run on this machine (preflight checks it)
    spec.write_text(
        "name: chk\ndataset: {path: /tmp}\ncluster: {provider: local, nodes: 2, gpus_per_node: 1,"
        f" master_port: {free_port()}, nccl: {{socket_ifname: lo}}}}\n"
    )
    assert main(["provision", str(spec), "--check", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["provider"] == "local" and len(res["ready_s"]) == 2
    assert res["nccl_env"] == {"NCCL_SOCKET_IFNAME": "lo"} and res["time_to_ready_s"] > 0


def test_check_bad_nccl_value_fails_with_the_field(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: chk\ndataset: {path: /tmp}\ncluster: {provider: local, nodes: 1, gpus_per_node: 1,"
        " nccl: {ib_hca: '==mlx5_0'}}\n"
    )
    assert main(["provision", str(spec), "--check"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "cluster.nccl.ib_hca" in out
