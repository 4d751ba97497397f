"""The SSH key from a Prefect Secret block (resolved in tasks/provision.py), used for a real login."""

import os
import uuid

import pytest

from nightloom.provision.base import ProvisionError
from tests.support.ci import skip_or_fail
from tests.support.ssh import make_spec

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def test_key_from_secret_block_logs_in(sshenv, tmp_path):  # noqa: F811
    if not os.environ.get("PREFECT_API_URL"):
        msg = "PREFECT_API_URL not set: run `.ci/services.sh start`"
        skip_or_fail(msg)
    from prefect.blocks.system import Secret

    from tasks.provision import make_provider

    name = f"nl-ssh-{uuid.uuid4().hex[:8]}"
    Secret(value=open(os.environ["NIGHTLOOM_SSH_KEY_FILE"]).read()).save(name)
    spec = make_spec(sshenv, tmp_path)
    spec.cluster.provider.key_secret = name
    spec.cluster.provider.key_env = "NL_UNSET_KEY_ENV"  # the env var path must not be what logs in
    p = make_provider(spec)
    host = spec.cluster.provider.hosts[0]
    conn = p.loop.run(p._connect(host, p._key(), p._known_hosts()))
    r = p.loop.run(conn.run("echo logged-in", check=False))
    assert r.stdout.strip() == "logged-in"
    conn.close()
    p.loop.close()
    spec.cluster.provider.key_secret = "nl-no-such-secret"
    with pytest.raises(ProvisionError, match="nl-no-such-secret"):
        make_provider(spec)
