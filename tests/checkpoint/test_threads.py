"""Snapshots (`state_dict`, `save`, `to_pure`, `checkpoint_tree`,
`tree_serialise_leaves`) read all states of a tree consistently, while other
threads step the same model; and they are not held up by another thread tracing a
different model."""

import io
import threading

import equinox as eqx
import jax.numpy as jnp
import numpy as np

import jaxstate


class Pair(eqx.Module):
    """Two states always updated together: a counter and a copy of it."""

    count: jaxstate.StateIndex
    copy: jaxstate.StateIndex

    def __init__(self):
        self.count = jaxstate.StateIndex(init=jnp.array(0, jnp.int32))
        self.copy = jaxstate.StateIndex(init=jnp.array(0, jnp.int32))

    def __call__(self):
        n = jaxstate.get_state(self.count) + 1
        jaxstate.set_state(self.count, n)
        jaxstate.set_state(self.copy, n)


def _run(threads):
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        return run

    workers = [threading.Thread(target=guarded(fn)) for fn in threads]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert not any(w.is_alive() for w in workers), "a thread hangs"
    if errors:
        raise errors[0]


def test_snapshots_are_consistent_while_eight_threads_step(tmp_path):
    model = Pair()
    step = jaxstate.jit(lambda m: m())
    steps_per_thread, snapshots_per_thread = 150, 40
    seen: list[tuple[str, int, int]] = []

    def stepper():
        for _ in range(steps_per_thread):
            step(model)

    def reader():
        last = 0
        for _ in range(steps_per_thread):
            now = int(jaxstate.get_state(model.count))
            assert now >= last  # eager reads never go back
            last = now

    def snapshotter(i):
        def run():
            for j in range(snapshots_per_thread):
                kind = ("state_dict", "to_pure", "save", "checkpoint_tree", "eqx")[
                    (i + j) % 5
                ]
                if kind == "state_dict":
                    d = jaxstate.state_dict(model)
                    pair = d["count"], d["copy"]
                elif kind == "to_pure":
                    state = jaxstate.to_pure(lambda: None, model)[1]
                    pair = state["count"], state["copy"]
                elif kind == "save":
                    path = tmp_path / f"{i}.npz"
                    jaxstate.save(path, model)
                    with np.load(path) as f:
                        pair = f["a0"].view(np.int32)[0], f["a1"].view(np.int32)[0]
                elif kind == "checkpoint_tree":
                    tree = jaxstate.checkpoint_tree(model)
                    pair = tree["count"], tree["copy"]
                else:
                    buffer = io.BytesIO()
                    jaxstate.tree_serialise_leaves(buffer, model)
                    buffer.seek(0)
                    items = []
                    while buffer.tell() < len(buffer.getvalue()):
                        items.append(np.load(buffer))
                    pair = items[1], items[3]  # after each state's header
                seen.append((kind, int(pair[0]), int(pair[1])))

        return run

    _run(
        [stepper] * 4
        + [reader] * 2
        + [snapshotter(0), snapshotter(1)]  # eight threads in all
    )
    assert int(jaxstate.get_state(model.count)) == 4 * steps_per_thread
    assert int(jaxstate.get_state(model.copy)) == 4 * steps_per_thread
    assert len(seen) == 2 * snapshots_per_thread
    assert {kind for kind, _, _ in seen} == {
        "state_dict",
        "to_pure",
        "save",
        "checkpoint_tree",
        "eqx",
    }
    inconsistent = [s for s in seen if s[1] != s[2]]
    assert not inconsistent, (
        f"inconsistent snapshots (kind, count, copy): {inconsistent[:5]}"
    )


def test_a_snapshot_is_not_held_up_by_another_model_being_traced(tmp_path):
    tracing, release = threading.Event(), threading.Event()
    busy, other = Pair(), Pair()

    def slow_to_trace(m):
        tracing.set()
        # Blocks the trace (and so the compile) of this call until released.
        assert release.wait(timeout=300)
        m()

    step = jaxstate.jit(slow_to_trace)
    done = threading.Event()
    results = {}

    def snapshots():
        tracing.wait()
        jaxstate.jit(lambda m: m())(other)  # a step of the other model, too
        results["state_dict"] = jaxstate.state_dict(other)
        results["to_pure"] = jaxstate.to_pure(lambda: None, other)[1]
        jaxstate.save(tmp_path / "other.npz", other)
        results["load"] = jaxstate.load(tmp_path / "other.npz", Pair())
        results["tree"] = jaxstate.checkpoint_tree(other)
        done.set()

    waiter = threading.Thread(target=snapshots)
    tracer = threading.Thread(target=step, args=(busy,))
    tracer.start()
    waiter.start()
    try:
        # Not a timing assertion: the trace cannot finish before `release` is set,
        # so every snapshot above happened while it was in progress (or never).
        assert done.wait(timeout=300), "a snapshot waited for another model's trace"
        assert not release.is_set() and tracer.is_alive()
    finally:
        release.set()
        tracer.join(timeout=300)
        waiter.join(timeout=300)
    assert results["state_dict"]["count"] == 1 == results["to_pure"]["copy"]
    assert jaxstate.get_state(results["load"].count) == 1
    assert int(jaxstate.get_state(busy.count)) == 1  # and the traced step ran
