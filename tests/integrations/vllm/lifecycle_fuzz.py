"""A seeded random workload for `lifecycle_engine.Engine`: requests over shared prefixes (some twice in a step),
aborts, and blocks lost between the scheduler's lookup and the worker's load; `fuzz_run` returns what the
engine's checks found."""
from __future__ import annotations

import random
import traceback
from pathlib import Path

from tests.integrations.vllm.lifecycle_engine import Engine, Shape


def fuzz_run(root: Path, seed: int, mode: str) -> list[str]:
    """Seed's random workload on an engine of mode "hot" (hot window), "plain" (full attention) or "plain_pc"
    (full attention, vLLM's prefix cache on); returns the problems found (exceptions included), [] if none."""
    rng = random.Random(seed)
    hot = mode == "hot"
    window = rng.choice([8, 12]) if hot else None
    shape = Shape(cpu_blocks=rng.choice([400, 800] if hot else [12, 24, 64, 400]), layers=rng.choice([2, 3]),
                  pool=rng.choice([40, 64] if hot else [24, 40, 64]), window=window, max_seqs=rng.choice([2, 4]),
                  batched=rng.choice([16, 32]), disk=rng.random() < 0.8, prefix_caching=mode == "plain_pc")
    engine = Engine(root, shape)
    engine.before_forward = _block_loser(rng)
    try:
        _random_requests(engine, rng)
        engine.run_out()
        leftovers = engine.leftovers()  # as the engine left them, before check_tiers waits on the tiers
        engine.check_tiers()
        problems = engine.problems + leftovers
    except Exception as e:  # noqa: BLE001  the run's problems say what raised, with the ones found before
        problems = engine.problems + ["raised: " + "".join(traceback.format_exception(e))[-3000:]]
    finally:
        engine.close()
    return [f"seed {seed} {mode} {shape}: {p}" for p in problems]


def _random_requests(engine: Engine, rng: random.Random) -> None:
    """30 or 60 steps of arrivals (prompts over three shared 70-token bases, some twice in a step) and aborts."""
    bases = [[rng.randrange(1, 800) for _ in range(70)] for _ in range(3)]
    num_requests = 0
    for _ in range(rng.choice([30, 60])):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            base, k = rng.choice(bases), rng.choice([0, 4, 9, 16, 23, 40, 60])
            prompt = base[:k] + [rng.randrange(1, 800) for _ in range(rng.choice([1, 3, 5, 8]))]
            if rng.random() < 0.3:
                prompt = base[: k + rng.choice([1, 2, 3, 4])]
            prompt, max_tokens = prompt[:100], rng.choice([1, 2, 5, 9])
            for _ in range(2 if rng.random() < 0.2 else 1):  # the same prompt twice in one step
                engine.add(f"r{num_requests}", list(prompt), max_tokens)
                num_requests += 1
        if engine.sched.requests and rng.random() < 0.08:
            engine.abort(rng.choice(list(engine.sched.requests)))
        engine.step()


def _block_loser(rng: random.Random):
    """A before_forward that, in 3 of 10 steps with loads, removes one loaded block (one layer or all) from
    every tier: a block lost between the scheduler's lookup and the worker's load."""
    def lose(engine: Engine, meta) -> None:
        if meta is None or not meta.loads or rng.random() > 0.3:
            return
        span = rng.choice(meta.loads)
        if not span.hashes:
            return
        i = rng.randrange(len(span.hashes))
        if engine.window is not None:  # a far block lost after its lookup stops the engine by design: lose
            # only blocks no other request has (no public view of the connector's request states)
            states = engine.sched.connector._scheduler._requests
            if any(span.hashes[i] in st.hashes for r, st in states.items() if r != span.req_id):
                return
        layers = [rng.randrange(engine.shape.layers)] if rng.random() < 0.5 else range(engine.shape.layers)
        cpu = engine.store.cpu
        # a pinned CPU copy cannot be lost (a reader holds it); the tier's pin state has no public view
        keys = [k for layer in layers for k in engine.store.keys(span.hashes[i:i + 1], layer)
                if not (cpu.contains(k) and cpu._pinned(k))]
        if keys:
            engine.store.chain.remove_many(keys)
    return lose
