"""Replica actors on a local Ray instance (2 replicas of a tiny random model, CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

ray = pytest.importorskip("ray")

from engine.async_engine import EngineError  # noqa: E402
from engine.cluster.cluster_engine import ClusterEngine  # noqa: E402
from engine.cluster.replica import launch_replicas  # noqa: E402
from engine.cluster.router import RouterConfig  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.outputs import RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tiny_lora_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    config = EngineConfig(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_seqs=4,
                          lora_modules={"sql": str(tiny_lora_dir)})
    actors = launch_replicas(config, 2, num_cpus=0.5)
    yield actors, load_tokenizer(tiny_model_dir)
    ray.shutdown()


def run(engine: ClusterEngine, prompts: list[list[int]], max_tokens: int = 4, sequential: bool = False,
        params: SamplingParams | None = None, lora: str | None = None):
    """Generate for every prompt (concurrently, or one after another with a refresh between),
    under LoRA adapter `lora` if given."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> object:
        last = None
        async for out in engine.generate(prompts[i], params, f"req-{i}-{id(engine)}", lora=lora):
            last = out
        return last

    async def each() -> list:
        if sequential:
            outs = []
            for i in range(len(prompts)):
                outs.append(await one(i))
                engine.refresh()  # the finished request's stored blocks reach the router
            return outs
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    engine.start()
    try:
        return asyncio.run(each())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "coordinated"])
def test_requests_complete_with_every_policy(cluster, policy):
    actors, tokenizer = cluster
    engine = ClusterEngine(actors, RouterConfig(policy=policy, block_size=BLOCK_SIZE), tokenizer, 0.01)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(10 + i)] for i in range(6)]
    outs = run(engine, prompts)
    assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in outs)
    assert sum(engine.num_dispatched) == 6
    assert not engine.router.queue and all(not r.in_flight for r in engine.router.replicas.values())


def test_unseeded_samples_differ_between_replicas_and_seeded_ones_agree(cluster):
    """Each replica's engine draws unseeded samples from its own stream (seed + its index), so one
    request sampled on both replicas differs; a request's own seed gives the same tokens on either."""
    actors, tokenizer = cluster
    prompt = [5, 9, 13, 17, 21]
    for seed in (None, 7):
        engine = ClusterEngine(actors, RouterConfig(policy="round-robin", block_size=BLOCK_SIZE), tokenizer, 0.01)
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=seed)
        first, second = run(engine, [prompt, prompt], params=params)
        assert engine.num_dispatched == [1, 1]
        assert (first.outputs[0].token_ids == second.outputs[0].token_ids) is (seed is not None)


def test_pooling_requests_return_each_prompts_pooled_state_through_the_replicas(cluster, tiny_model_dir):
    """What /v1/embeddings, /score and /classify send (pooling requests) comes back from whichever
    replica served it, as the offline engine pools it."""
    from engine import LLM

    actors, tokenizer = cluster
    engine = ClusterEngine(actors, RouterConfig(policy="least-loaded", block_size=BLOCK_SIZE), tokenizer, 0.01)
    prompts = [[(5 * i + j) % 300 + 3 for j in range(6 + 3 * i)] for i in range(4)]
    outs = run(engine, prompts, params=SamplingParams(max_tokens=1, pooling="mean"))
    assert all(engine.num_dispatched)  # both replicas served some
    expected = LLM(str(tiny_model_dir), dtype="float32").embed(prompts, pooling="mean", normalize=False,
                                                              use_tqdm=False)
    for out, reference in zip(outs, expected, strict=True):
        assert out.finished and out.outputs[0].token_ids == []
        assert out.embedding == pytest.approx(reference.outputs.embedding, abs=1e-5)


def test_lora_requests_are_served_by_their_adapter_on_every_replica(cluster, tiny_model_dir, tiny_lora_dir):
    """Both replicas load the adapter; requests naming it answer as one engine with it does, and
    an adapter no replica loaded is refused before anything runs."""
    from engine import LLM, LoRARequest

    actors, tokenizer = cluster
    prompts = [[(5 * i + j) % 300 + 3 for j in range(9 + i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    offline = LLM(str(tiny_model_dir), dtype="float32", block_size=BLOCK_SIZE, enable_lora=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(
        prompts, greedy, use_tqdm=False, lora_request=LoRARequest("sql", 1, str(tiny_lora_dir)))]
    engine = ClusterEngine(actors, RouterConfig(policy="round-robin", block_size=BLOCK_SIZE), tokenizer, 0.01)
    assert engine.lora_names == {"sql"}
    outs = run(engine, prompts, lora="sql")
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.num_dispatched == [2, 2]
    base = run(ClusterEngine(actors, RouterConfig(block_size=BLOCK_SIZE), tokenizer, 0.01), prompts)
    assert [o.outputs[0].token_ids for o in base] != expected  # the adapter changed the answers
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nosql'"):
        run(ClusterEngine(actors, RouterConfig(block_size=BLOCK_SIZE), tokenizer, 0.01), prompts[:1], lora="nosql")


def test_adapters_load_and_unload_on_every_replica_at_run_time(cluster, tiny_model_dir, tmp_path):
    """add_lora reaches every replica (a refused one is rolled back everywhere); requests then name
    it on any replica; remove_lora takes it from all of them."""
    from engine import LLM, LoRARequest
    from tests.helpers import write_lora_adapter

    actors, tokenizer = cluster
    folder = write_lora_adapter(tiny_model_dir, tmp_path / "extra", ["o_proj", "up_proj"], seed=9)
    prompts = [[(3 * i + j) % 300 + 3 for j in range(8 + i)] for i in range(4)]
    offline = LLM(str(tiny_model_dir), dtype="float32", block_size=BLOCK_SIZE, enable_lora=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False,
        lora_request=LoRARequest("extra", 1, str(folder)))]
    engine = ClusterEngine(actors, RouterConfig(policy="round-robin", block_size=BLOCK_SIZE), tokenizer, 0.01)
    asyncio.run(engine.add_lora(LoRARequest("extra", 2, str(folder))))
    assert engine.lora_names == {"sql", "extra"}
    assert [o.outputs[0].token_ids for o in run(engine, prompts, lora="extra")] == expected
    assert engine.num_dispatched == [2, 2]
    with pytest.raises(ValueError, match="folder not found"):
        asyncio.run(engine.add_lora(LoRARequest("bad", 3, str(tmp_path / "none"))))
    asyncio.run(engine.remove_lora("extra"))
    assert all(set(ray.get(a.shape.remote()).lora_paths) == {"sql"} for a in actors)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'extra'"):
        run(ClusterEngine(actors, RouterConfig(block_size=BLOCK_SIZE), tokenizer, 0.01), prompts[:1], lora="extra")


def test_a_refused_unload_leaves_the_adapter_whole_on_every_replica(cluster, tiny_model_dir, tmp_path):
    """remove_lora while a request uses the adapter is refused as a whole: by the cluster itself
    for a request it routed, and where only one replica knows of the request (here sent to it
    directly), the replicas that had already unloaded it load it again, so it still serves
    everywhere. A replica's refusal of a request reaches the caller as the engine's ValueError,
    not Ray's remote traceback."""
    from engine import LoRARequest
    from tests.helpers import write_lora_adapter

    actors, tokenizer = cluster
    folder = write_lora_adapter(tiny_model_dir, tmp_path / "held", ["o_proj"], seed=3)
    engine = ClusterEngine(actors, RouterConfig(policy="round-robin", block_size=BLOCK_SIZE), tokenizer, 0.01)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def loaded_on_replicas() -> list[bool]:
        return ["held" in (await a.shape.remote()).lora_paths for a in actors]

    async def drain(outputs) -> None:
        with contextlib.suppress(EngineError):
            async for _ in outputs:
                pass

    async def scenario() -> None:
        engine.start()
        try:
            await engine.add_lora(LoRARequest("held", 5, str(folder)))
            direct = actors[0].generate.options(num_returns="streaming").remote([5, 6, 7], long, "direct", 0, "held")
            first = await (await direct.__anext__())
            with pytest.raises(ValueError, match="in flight"):
                await engine.remove_lora("held")
            assert not first.finished and await loaded_on_replicas() == [True, True] and "held" in engine.lora_names
            await actors[0].abort.remote("direct")
            with pytest.raises(EngineError, match="aborted"):  # the replica's stream ends
                async for ref in direct:
                    await ref

            routed = engine.generate([5, 6, 7], long, "routed", lora="held")
            await routed.__anext__()
            with pytest.raises(ValueError, match="serves 1 request"):
                await engine.remove_lora("held")
            engine.abort("routed")
            await drain(routed)
            for i in range(2):  # round-robin: one on each replica
                outs = [o async for o in engine.generate([9, 8, 7 + i], short, f"after-{i}", lora="held")]
                assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

            await engine.remove_lora("held")
            assert await loaded_on_replicas() == [False, False]
            engine.lora_names = engine.lora_names | {"ghost"}  # a name the replicas do not have
            with pytest.raises(ValueError, match="unknown LoRA adapter 'ghost'") as refused:
                await drain(engine.generate([5, 6], short, "ghost", lora="ghost"))
            assert "ray::" not in str(refused.value) and "Traceback" not in str(refused.value)
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_the_router_learns_output_lengths_from_requests_that_stop_on_their_own(cluster):
    actors, tokenizer = cluster
    prompt = [(3 * j) % 300 + 3 for j in range(10)]
    (greedy,) = run(ClusterEngine(actors, RouterConfig(block_size=BLOCK_SIZE), tokenizer, 0.01), [prompt], 3)
    stop = greedy.outputs[0].token_ids[2]
    length = greedy.outputs[0].token_ids.index(stop) + 1  # where a stop on that token ends the output
    engine = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 0.01)
    budget = 7
    assert engine.router.output_lengths.predict(budget) == budget  # nothing learned yet
    outs = run(engine, [prompt] * 8, params=SamplingParams(temperature=0.0, max_tokens=budget, stop_token_ids=[stop]))
    assert all(o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) == length for o in outs)
    # eight stops at `length` of 7: the router now plans requests of that budget at that length
    assert engine.router.output_lengths.predict(budget) == length < budget


def test_a_replica_refusing_its_settings_fails_the_launch_with_the_engines_reason(cluster, tiny_model_dir):
    _, tokenizer = cluster
    no_scales = EngineConfig(str(tiny_model_dir), block_size=BLOCK_SIZE, kv_cache_dtype="fp8")
    actors = launch_replicas(no_scales, 1, num_cpus=0.5)
    try:
        with pytest.raises(ValueError, match="a replica refused to start: kv_cache_dtype=fp8 needs calibrated") as info:
            ClusterEngine(actors, RouterConfig(block_size=BLOCK_SIZE), tokenizer, 0.01)
        assert "Traceback" not in str(info.value)
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_caller_leaving_while_its_request_waits_in_the_router_takes_it_out(cluster):
    """Each replica's KV plan is full with one 200-token request, so a third waits in the
    router's queue; its caller gives up there, and it is never dispatched."""
    actors, tokenizer = cluster
    engine = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 0.01)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def drain(stream) -> bool:
        outs = [out async for out in stream]
        return outs[-1].finished

    async def scenario() -> tuple[bool, list[bool]]:
        engine.start()
        try:
            running = [asyncio.create_task(drain(engine.generate([3 + i, 7, 9], params, f"big-{i}"))) for i in range(2)]
            while sum(engine.num_dispatched) < 2:
                await asyncio.sleep(0.01)
            late = engine.generate([4, 8, 12], params, "late")
            waiting = asyncio.create_task(anext(late))
            while not any(r.request_id == "late" for r in list(engine.router.queue)):
                await asyncio.sleep(0.01)
            waiting.cancel()  # as the server cancels a request whose client went away
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await asyncio.sleep(0.1)
            gone = not any(r.request_id == "late" for r in list(engine.router.queue))
            return gone, await asyncio.wait_for(asyncio.gather(*running), 60)
        finally:
            engine.shutdown()

    gone, finished = asyncio.run(scenario())
    assert gone and finished == [True, True]
    assert sum(engine.num_dispatched) == 2  # the late one never reached a replica


def test_a_request_aborted_between_its_dispatch_and_its_stream_gives_its_place_back(cluster):
    """An abort landing after the router placed a waiting request but before its task woke to
    stream it (a client hanging up just as a slot freed): the replica's slot and KV plan are
    released, or every such abort would shrink the cluster until nothing is dispatched again."""
    actors, tokenizer = cluster
    engine = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 0.01)
    place = engine._place

    def place_then_abort(dispatches) -> None:  # the abort arrives in the same turn of the loop
        place(dispatches)
        for d in dispatches:
            if d.request_id == "victim" and (task := engine._tasks.get(d.request_id)) is not None:
                task.cancel()

    engine._place = place_then_abort
    big = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def drain(stream) -> RequestOutput:
        outs = [out async for out in stream]
        return outs[-1]

    async def scenario() -> tuple[list[list[str]], RequestOutput]:
        engine.start()
        try:
            # each replica's KV plan is full with one 200-token request: the victim waits in the router
            running = [asyncio.create_task(drain(engine.generate([3 + i, 7, 9], big, f"big-{i}"))) for i in range(2)]
            while sum(engine.num_dispatched) < 2:
                await asyncio.sleep(0.01)
            victim = asyncio.create_task(drain(engine.generate([4, 8, 12], big, "victim")))
            with pytest.raises(EngineError, match="aborted"):  # dispatched once a big one ends, aborted at once
                await asyncio.wait_for(victim, 60)
            await asyncio.wait_for(asyncio.gather(*running), 60)
            engine._place = place
            after = await drain(engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), "after"))
            return [list(r.in_flight) for r in engine.router.replicas.values()], after
        finally:
            engine.shutdown()

    in_flight, after = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert in_flight == [[], []] and after.finished


def test_queue_time_counts_the_routers_queue_and_the_replicas(cluster):
    """A request that waited in the router's queue before any replica could take it reports that
    wait in its queue time (what /metrics' request_queue_time_seconds shows), not only the replica's."""
    actors, tokenizer = cluster
    engine = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 0.01)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def last(stream):
        outs = [out async for out in stream]
        return outs[-1]

    async def scenario():
        engine.start()
        try:
            big = [asyncio.create_task(last(engine.generate([3 + i, 7, 9], params, f"q-big-{i}"))) for i in range(2)]
            while sum(engine.num_dispatched) < 2:
                await asyncio.sleep(0.01)
            submitted = time.monotonic()
            late = asyncio.create_task(last(engine.generate([4, 8, 12], params, "q-late")))  # fits nowhere yet
            while sum(engine.num_dispatched) < 3:  # it waits in the router until a big one finishes
                await asyncio.sleep(0.01)
            waited = time.monotonic() - submitted
            outs = await asyncio.wait_for(asyncio.gather(*big, late), 60)
            return waited, outs
        finally:
            engine.shutdown()

    waited, outs = asyncio.run(scenario())
    assert all(o.queue_time_s is not None and o.queue_time_s >= 0 for o in outs)
    assert waited > 0.1 and outs[-1].queue_time_s >= 0.9 * waited


def test_a_request_id_in_use_is_refused(cluster):
    actors, tokenizer = cluster
    engine = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 0.01)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def scenario():
        first = engine.generate([3, 4, 5], params, "same")
        finished = (await anext(first)).finished
        with pytest.raises(ValueError, match="already in use"):
            await anext(engine.generate([6, 7], params, "same"))
        async for out in first:
            finished = out.finished
        again = [out async for out in engine.generate([6, 7], params, "same")]  # free again once it ended
        return finished and again[-1].finished

    engine.start()
    try:
        assert asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_shared_prefix_lands_on_one_replica_under_coordinated(cluster):
    actors, tokenizer = cluster
    system = [(5 * j) % 300 + 3 for j in range(24)]  # 6 shared blocks
    prompts = [system + [100 + i, 200 + i, 50 + i] for i in range(4)]
    coordinated = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 0.01)
    outs = run(coordinated, prompts, sequential=True)
    assert sorted(coordinated.num_dispatched) == [0, 4]
    assert all(o.num_cached_tokens >= len(system) for o in outs[1:])

    round_robin = ClusterEngine(actors, RouterConfig(policy="round-robin", block_size=BLOCK_SIZE), tokenizer, 0.01)
    run(round_robin, [system + [90 + i] for i in range(4)], sequential=True)
    assert round_robin.num_dispatched == [2, 2]


def test_a_concurrent_shared_prefix_burst_lands_together_under_coordinated(cluster):
    """Sent at once, so no replica has stored the prompt yet: only the router's pending blocks
    (what the first request will compute) can keep the others with it."""
    actors, tokenizer = cluster
    system = [(11 * j) % 290 + 7 for j in range(24)]  # 6 shared blocks, cached nowhere yet
    prompts = [system + [120 + i, 220 + i, 60 + i] for i in range(4)]
    engine = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 0.01)
    outs = run(engine, prompts)
    assert sorted(engine.num_dispatched) == [0, 4]
    assert sorted(o.num_cached_tokens >= len(system) for o in outs) == [False, True, True, True]
    assert all(not r.pending for r in engine.router.replicas.values())  # nothing outlives its request


def test_a_new_router_joining_mid_stream_resyncs_from_snapshots(cluster):
    actors, tokenizer = cluster
    warm = ClusterEngine(actors, RouterConfig(policy="round-robin", block_size=BLOCK_SIZE), tokenizer, 0.01)
    run(warm, [[3 + j for j in range(12)], [40 + j for j in range(12)]])
    # `warm` drained the events so far: a fresh router sees a seq gap and must use snapshots
    fresh = ClusterEngine(actors, RouterConfig(policy="coordinated", block_size=BLOCK_SIZE), tokenizer, 60)
    fresh.start()  # its first refresh finds every mirror stale
    fresh.shutdown()
    for replica_id, actor in enumerate(actors):
        hashes, _ = ray.get(actor.snapshot.remote())
        mirror = fresh.router.replicas[replica_id].prefix
        assert not mirror.is_stale and mirror.hashes == hashes and hashes


def test_a_request_waiting_on_a_busy_replica_migrates_and_completes(cluster, tiny_model_dir):
    """Replica 0 runs one sequence at a time and is busy with a request the router never saw, so
    the request that prefix affinity sends there waits; the router withdraws it unstarted and
    replica 1 serves it."""
    _, tokenizer = cluster
    one_slot = EngineConfig(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=128, max_num_seqs=1)
    actors = launch_replicas(one_slot, 2, num_cpus=0.5)
    config = RouterConfig(policy="coordinated", block_size=BLOCK_SIZE, migrate_below_free_fraction=0.99)
    engine = ClusterEngine(actors, config, tokenizer, 0.01)
    system = [(3 * j) % 300 + 3 for j in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def complete(prompt: list[int], request_id: str):
        return [out async for out in engine.generate(prompt, params, request_id)][-1]

    engine.start()
    try:
        asyncio.run(complete(system + [7], "warm"))  # replica 0 (idle tie) now caches `system`
        busy = actors[0].generate.options(num_returns="streaming").remote(
            [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), "outside")
        while engine.stats().cluster.replicas[0].stats.num_running == 0:
            time.sleep(0.005)
        moved = asyncio.run(complete(system + [9], "moved"))
        actors[0].abort.remote("outside")
        del busy
    finally:
        engine.shutdown()
        for actor in actors:
            ray.kill(actor)
    assert moved.finished and len(moved.outputs[0].token_ids) == 6
    assert engine.router.num_migrated == 1 and engine.num_dispatched == [2, 1]


def test_killing_a_replica_mid_load_loses_no_request_and_it_rejoins(cluster, tiny_lora_dir):
    """Runs last: it kills replica 0 (Ray restarts it). It rejoins with the adapter loaded at run time too."""
    from engine import LoRARequest

    actors, tokenizer = cluster
    engine = ClusterEngine(actors, RouterConfig(policy="round-robin", block_size=BLOCK_SIZE), tokenizer, 0.02)
    asyncio.run(engine.add_lora(LoRARequest("late", 9, str(tiny_lora_dir))))
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)

    async def one(i: int) -> str:
        try:
            async for out in engine.generate([5 + i, 9, 11 + i], params, f"kill-{i}"):
                if out.finished:
                    return "completed"
        except EngineError:
            return "error"
        return "ended without finishing"

    async def scenario() -> tuple[list[str], int]:
        engine.start()
        try:
            tasks = [asyncio.create_task(one(i)) for i in range(6)]
            # list() copies atomically: the router's thread keeps changing the dict
            while not any(e.has_first_token for e in list(engine.router.replicas[0].in_flight.values())):
                await asyncio.sleep(0.01)
            ray.kill(actors[0], no_restart=False)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            while not engine.router.replicas[0].is_alive:  # Ray restarts it; a report readmits it
                await asyncio.sleep(0.1)
            assert "late" in (await actors[0].shape.remote()).lora_paths
            before = engine.num_dispatched[0]
            again = [asyncio.create_task(one(10 + i)) for i in range(4)]
            outcomes += await asyncio.wait_for(asyncio.gather(*again), 120)
            return outcomes, engine.num_dispatched[0] - before
        finally:
            engine.shutdown()

    outcomes, num_after_rejoin = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert len(outcomes) == 10 and set(outcomes) <= {"completed", "error"}
    assert "error" in outcomes[:6]  # replica 0 had streamed tokens when it died
    assert outcomes[6:] == ["completed"] * 4
    assert num_after_rejoin >= 1


@pytest.mark.parametrize("policy", ["coordinated", "least-loaded"])  # waiting in the router's queue / the replica's
def test_priority_reaches_the_router_queue_and_the_replica(cluster, tiny_model_dir, policy):
    """One replica with one slot, busy: of two requests waiting, the more urgent one runs first;
    a router serving in arrival order refuses a priority it would ignore."""
    _, tokenizer = cluster
    ranked = EngineConfig(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=128, max_num_seqs=1,
                          scheduling_policy="priority")
    actors = launch_replicas(ranked, 1, num_cpus=0.5)
    router = RouterConfig(policy=policy, block_size=BLOCK_SIZE, scheduling_policy="priority")
    engine = ClusterEngine(actors, router, tokenizer, 0.01)
    finished: list[str] = []

    async def complete(request_id: str, priority: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for out in engine.generate([5, 6, 7, len(request_id)], params, request_id, priority):
            if out.finished:
                finished.append(request_id)

    async def scenario() -> None:
        blocker = asyncio.create_task(complete("blocker", 0, 400))
        while engine.stats().cluster.replicas[0].stats.num_running == 0:
            await asyncio.sleep(0.005)
        low = asyncio.create_task(complete("low", 5, 2))
        while (stats := engine.stats().cluster).num_queued + stats.replicas[0].stats.num_waiting == 0:
            await asyncio.sleep(0.005)  # low waits, in the router's queue or the replica's
        await asyncio.gather(blocker, low, complete("high", -1, 2))

    engine.start()
    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
        for actor in actors:
            ray.kill(actor)
    # (the blocker's 400 outputs may still be in flight when the short ones end: its place varies)
    assert sorted(finished) == ["blocker", "high", "low"] and finished.index("high") < finished.index("low")
    fcfs = ClusterEngine(cluster[0], RouterConfig(block_size=BLOCK_SIZE), tokenizer, 0.01)

    async def refused() -> None:
        async for _ in fcfs.generate([5, 6], SamplingParams(max_tokens=1), "ranked", priority=1):
            pass

    fcfs.start()
    try:
        with pytest.raises(ValueError, match="priority scheduling policy"):
            asyncio.run(refused())
    finally:
        fcfs.shutdown()
