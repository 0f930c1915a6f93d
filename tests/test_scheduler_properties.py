"""Property test: random add / schedule / update / abort sequences on tiny pools.

After every schedule and every update: free + used == total blocks, each block's reference count
equals its block-table references, blocks are shared only by fork or prefix, budgets hold (see
`check_invariants`, including the adaptive prefill budget when a target ITL is set, with
synthetic step costs reported as the engine reports measured ones, and with speculative drafts
of which a random part is wrong). At the end, under FCFS, every request finishes (no starvation), and every
request that was not aborted produced exactly the tokens it produces when run alone on a large
pool — whatever preemption, swapping, chunking or prefix sharing happened on the way.
"""

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler
from tests.fake_runner import FakeRunner, StepCost, check_invariants, run_steps

BS = 4
MAX_LEN = 32
EOS = 3

PREFIXES = [list(range(50, 50 + 12)), list(range(60, 60 + 5)), []]

request_spec = st.tuples(
    st.sampled_from(range(len(PREFIXES))),            # shared prefix
    st.integers(1, 10),                               # own suffix length
    st.integers(1, 12),                               # max_tokens
    st.integers(0, 3),                                # priority
    st.sampled_from([1, 1, 1, 2]),                    # n
    st.booleans(),                                    # ignore_eos
)

op = st.one_of(
    st.tuples(st.just("add"), request_spec),
    st.tuples(st.just("add"), request_spec),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)

config = st.fixed_dictionaries({
    "num_blocks": st.integers(8, 14),
    "num_cpu_blocks": st.sampled_from([0, 6, 32, 32]),
    "mode": st.sampled_from(["recompute", "swap", "swap", "auto"]),
    "target_itl_ms": st.sampled_from([None, None, 12.0, 30.0]),   # with chunked prefill only
    "per_block": st.sampled_from([1e-6, 1.0]),      # auto: swap cheap, or dearer than recompute
    "prefix": st.booleans(),
    "chunked": st.booleans(),
    "budget": st.sampled_from([7, 16, 40]),
    "max_num_seqs": st.integers(2, 10),
    "spec_k": st.sampled_from([0, 0, 2, 4]),        # speculative drafts, some rejected
    "spec_adaptive": st.booleans(),
    "window": st.sampled_from([0, 0, 6, 9]),        # blocks that slid out of it are freed
})


def build(c, policy="fcfs", num_blocks=None):
    budget = c["budget"] if c["chunked"] else max(c["budget"], MAX_LEN)
    return Scheduler(
        SchedulerConfig(max_num_seqs=c["max_num_seqs"], max_num_batched_tokens=budget,
                        max_model_len=MAX_LEN, enable_chunked_prefill=c["chunked"],
                        policy=policy, preemption_mode=c["mode"],
                        target_itl_ms=c["target_itl_ms"] if c["chunked"] else None,
                        num_speculative_tokens=c["spec_k"], spec_adaptive=c["spec_adaptive"]),
        CacheConfig(BS, (num_blocks or c["num_blocks"]) + bool(c["window"]),  # + the null
                    c["num_cpu_blocks"], c["prefix"], c["window"]))


def make_request(i, spec):
    prefix, suffix, max_tokens, priority, n, ignore_eos = spec
    prompt = PREFIXES[prefix] + [(i * 13 + k) % 40 + 4 for k in range(suffix)]
    max_tokens = min(max_tokens, MAX_LEN - len(prompt))
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0)
    return Request(f"r{i}", prompt, params, eos_token_id=EOS, arrival_time=float(i),
                   priority=priority)


def drive(s, ops, c):
    runner = FakeRunner(s, StepCost(per_block=c["per_block"]),
                        draft_rng=random.Random(len(ops)))
    outputs, added, aborted = {}, [], set()
    for kind, arg in ops:
        if kind == "add":
            r = make_request(len(added), arg)
            s.add_request(r)
            added.append(r)
        elif kind == "abort" and added:
            rid = added[arg % len(added)].request_id
            aborted.update(s.finish_requests([rid], RequestStatus.FINISHED_ABORTED))
            aborted.add(rid)
            check_invariants(s, None)
        elif kind == "step":
            for _ in range(arg):
                out = s.schedule()
                check_invariants(s, out)
                for o in s.update_from_output(out, runner.execute(out)):
                    outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                check_invariants(s, None)
    for rid, toks in run_steps(s, runner, max_steps=2000, check=check_invariants).items():
        outputs.setdefault(rid, []).extend(toks)
    return outputs, added, aborted


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=config, ops=st.lists(op, min_size=4, max_size=50),
       policy=st.sampled_from(["fcfs", "priority", "sjf"]))
def test_random_workloads_keep_invariants_and_outputs(c, ops, policy):
    s = build(c, policy)
    outputs, added, aborted = drive(s, ops, c)
    k = s.counters
    for name, happened in [("preempted", k.num_preemptions), ("swapped", k.swap_out_blocks),
                           ("recomputed", k.num_preemptions_recompute),
                           ("budget below the cap", s.prefill_budget < s.config.max_num_batched_tokens),
                           ("prefix hit", k.prefix_cache_hits), ("aborted", aborted),
                           ("forked", any("#" in rid for rid in outputs)),
                           ("drafts accepted", s.spec_counters.num_accepted_tokens),
                           ("drafts rejected", s.spec_counters.num_accepted_tokens
                            < s.spec_counters.num_draft_tokens),
                           ("slid out of the window", s.kv.num_window_freed)]:
        event(f"{name}: {bool(happened)}")
    # Everything finished and returned its blocks (FCFS: no starvation; priority: drained).
    assert not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - bool(c["window"])   # the null
    assert not s.kv.block_tables and not s.kv.cpu_tables
    # Every request that was not aborted produced its stand-alone output.
    for r in added:
        if r.request_id in aborted:
            continue
        alone = build(c, num_blocks=64)
        fresh = make_request(int(r.request_id[1:]), (0, 1, 1, 0, 1, False))
        alone.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling_params,
                                  eos_token_id=EOS, arrival_time=fresh.arrival_time))
        expected = run_steps(alone, FakeRunner(alone))
        for rid, toks in expected.items():
            assert outputs.get(rid) == toks, f"{rid}: {outputs.get(rid)} != alone {toks}"
