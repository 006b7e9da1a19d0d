"""The Mooncake transport: the hand-off equality test, run inside a loopback-only network
namespace (the Transfer Engine listens on all interfaces whatever address it is given).

The pytest test starts this file as a script under `unshare -n`; the script hands a
prompt's KV from a prefill engine core to a decode engine core over Mooncake and checks
the tokens against a mixed core's and that every block is freed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"Mooncake is not installed (make test installs it): {exc}"
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
        if probe.returncode != 0:
            return f"cannot make a network namespace: {probe.stderr.decode().strip()}"
    return None


def run_in_namespace(script: str, *args: str, done: str) -> None:
    """Runs `script` with `args` in a loopback-only network namespace (skips where Mooncake
    or namespaces are missing); it must exit 0 and print `done`."""
    missing = _mooncake_missing()
    if missing:
        pytest.skip(missing)
    user_ns = subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0
    command = f"ip link set lo up && exec {sys.executable} {script} {' '.join(args)}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        ["unshare", "-rn" if user_ns else "-n", "sh", "-c", command],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, MC_LOG_LEVEL="ERROR", EMBER_CLUSTER_SECRET="mooncake-test",
                 PYTHONPATH=root),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert done in result.stdout


def test_mooncake_transport_matches_a_mixed_worker_in_a_network_namespace(tiny_checkpoint):
    run_in_namespace(__file__, str(tiny_checkpoint("llama")), done="MOONCAKE OK")


def _check(checkpoint: str) -> None:
    from ember.config import EngineConfig
    from ember.engine.core import EngineCore
    from ember.engine.messages import EngineCoreRequest
    from ember.kv.params import KVTransferParams
    from ember.sampling_params import SamplingParams

    def core(kv_cache_memory=4 << 20, **options):
        config = EngineConfig(
            model=checkpoint, kv_cache_memory=kv_cache_memory, block_size=4, **options
        )
        return EngineCore.from_config(config)

    def run(engine, request):
        engine.add_request(request)
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
            time.sleep(0.001)
        return [t for o in outputs for t in o.new_token_ids], outputs

    prompt, params = list(range(5, 40)), SamplingParams(temperature=0.0, max_tokens=10)
    want, _ = run(core(), EngineCoreRequest("ref", prompt, params, 10, []))
    prefill = core(kv_role="prefill", kv_transport="mooncake")
    decode = core(kv_role="decode", kv_transport="mooncake", kv_cache_memory=3 << 20)
    kv = KVTransferParams(do_remote_decode=True)
    _, outputs = run(prefill, EngineCoreRequest("p", prompt, params, 1, [], kv_transfer=kv))
    remote = outputs[-1].kv_transfer_params
    assert remote.mooncake_session, "the prefill worker advertised no Mooncake endpoint"
    kv = KVTransferParams(remote_prefill=remote)
    got, _ = run(decode, EngineCoreRequest("d", prompt, params, 10, [], kv_transfer=kv))
    assert remote.first_token_ids + got == want, (remote.first_token_ids + got, want)
    stats = decode.stats()
    assert (stats.kv_loads_ok, stats.kv_loads_failed) == (1, 0), stats
    assert stats.num_prompt_tokens_computed == 0
    assert stats.kv_bytes_received == len(remote.block_ids) * remote.block_bytes
    deadline = time.monotonic() + 10
    while prefill.kv_cache.num_free_blocks != prefill.kv_cache.num_blocks:
        assert time.monotonic() < deadline, "the prefill worker's blocks were not released"
        prefill.step()
        time.sleep(0.01)
    assert decode.kv_cache.num_free_blocks == decode.kv_cache.num_blocks
    assert prefill.stats().kv_holds_expired == 0
    for engine in (prefill, decode):
        engine.close()
    print("MOONCAKE OK", flush=True)
    os._exit(0)  # the Transfer Engine's threads take a second to wind down otherwise


if __name__ == "__main__":
    _check(sys.argv[1])
