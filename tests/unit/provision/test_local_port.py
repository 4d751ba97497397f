"""The local provider's rendezvous port: a port the spec names is used when free; unset, the OS gives a free one, so
two local runs on one machine (two notebooks, two test lanes) never race for the default 29500."""

from __future__ import annotations

import socket

from nightloom.provision.local import LocalProvider, free_port
from nightloom.spec import ClusterSpec, DatasetSpec, RunSpec, StorageSpec


def _spec(tmp_path, **cluster) -> RunSpec:
    return RunSpec(
        name="port",
        dataset=DatasetSpec(path=str(tmp_path)),
        cluster=ClusterSpec(nodes=1, gpus_per_node=1, name="port", **cluster),
        storage=StorageSpec(root=str(tmp_path / "runs")),
    )


def test_a_named_free_port_is_used(tmp_path):
    port = free_port()
    assert LocalProvider(_spec(tmp_path, master_port=port)).acquire().master_port == port


def test_a_named_port_held_by_another_process_gives_way_to_a_free_one(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        got = LocalProvider(_spec(tmp_path, master_port=port)).acquire().master_port
    assert got != port


def test_unset_the_port_is_not_the_default_but_one_the_os_gives(tmp_path):
    spec = _spec(tmp_path)
    assert spec.cluster.master_port == 29500  # the default other providers use
    # with 29500 free (as here, unless another run holds it) the provider still does not take it unasked
    assert LocalProvider(spec).acquire().master_port != 29500
