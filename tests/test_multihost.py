"""Multi-host: the same SPMD program in 2 processes x 4 CPU devices on 127.0.0.1 (gloo
collectives), each process feeding only its own devices' shards; a process that dies
makes the other fail with a clear error instead of hanging.

This file is also the worker: `python test_multihost.py PROCESS_ID PORT [DIE_ID]`.
"""
import os
import socket
import subprocess
import sys
import time

import pytest

NUM_PROCESSES, LOCAL_DEVICES = 2, 4
HEARTBEAT_S = 5      # how soon the survivors notice a dead process
TIMEOUT_S = 90


def _worker(process_id: int, port: int, die_id: int) -> None:
    import jax
    import numpy as np
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_S)
    import gspmd
    from gspmd.models import mlp

    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
    step = mlp.make_train_step(mesh)
    params, x, y = mlp.example_inputs(batch=16)
    partitioned = gspmd.jit(step, mesh=mesh, backend="jax")
    exe = partitioned.lower(params, x, y).jax_executable()
    # x arrives as a jax.Array in our layout, built from this process's shards only; y as
    # a jax.Array replicated on all 8 devices, which each process re-slices locally.
    x_local = jax.make_array_from_callback(x.shape, exe.input_sharding(2), lambda index: x[index])
    everywhere = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)),
                                            jax.sharding.PartitionSpec())
    y_global = jax.make_array_from_callback(y.shape, everywhere, lambda index: y[index])
    if process_id == die_id:
        os._exit(3)
    cases = [(step, (params, x_local, y_global), (params, x, y)),
             (step, mlp.example_inputs(batch=5), mlp.example_inputs(batch=5))]   # uneven: assembled outputs
    for fn, args, host_args in cases:
        out = gspmd.jit(fn, mesh=mesh, backend="jax")(*args)
        with jax.default_device(jax.local_devices()[0]):
            want = jax.jit(fn)(*host_args)
        for o, w in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
            for shard in o.addressable_shards:
                np.testing.assert_allclose(np.asarray(shard.data), np.asarray(w)[shard.index], rtol=1e-4, atol=1e-5)
    print(f"process {process_id}: same results as one device", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(die_id: int = -1) -> list[tuple[int, str]]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # each process: 4 devices
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-u", __file__, str(i), str(port), str(die_id)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(NUM_PROCESSES)]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"multi-host run hung for {TIMEOUT_S} s")
        results.append((p.returncode, out))
    return results


def test_two_processes_give_one_device_results():
    for i, (rc, out) in enumerate(_launch()):
        assert rc == 0 and "same results" in out, f"process {i} (rc={rc}):\n{out[-3000:]}"


@pytest.mark.parametrize("die_id", [0, 1])     # the coordinator, or the other process
def test_a_dead_process_fails_the_other_quickly(die_id):
    start = time.monotonic()
    (survivor_rc, survivor_out), = [r for i, r in enumerate(_launch(die_id)) if i != die_id]
    assert survivor_rc != 0
    assert "JAX distributed service detected fatal errors" in survivor_out, survivor_out[-3000:]
    assert time.monotonic() - start < 6 * HEARTBEAT_S


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
