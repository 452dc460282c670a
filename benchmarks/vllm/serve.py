"""offload-core served inside a real vLLM engine, beside vLLM's own CPU offloading.

For each shape and host block size, three engines run one after another, each in a process of
its own: vLLM's ``OffloadingConnector`` with offload-core's spec, the same connector with vLLM's
own ``CPUOffloadingSpec``, and no offloading. Each engine runs three phases:

1. **latency** (vLLM's own ``_latency_test`` pattern, tests/v1/kv_connector/unit/
   test_offloading_connector.py): a long prompt cold, again (a GPU prefix hit), then
   ``reset_prefix_cache()`` once the stores are done, then again (a host hit). One warm-up
   iteration, then ``--iters``; time to first token of each (vLLM's request metrics), and the
   greedy tokens of the host hit compared with the GPU hit's, every iteration;
2. **mix**: requests over shared prefixes that together exceed the GPU cache (so blocks are
   evicted and come back from host memory), a fixed number in flight; throughput and TTFT
   percentiles;
3. **decode**: requests with fresh prompts decoding together while their prompts are stored;
   time per output token, and the engine's steps while the stores run over its steps once they
   are done, both against the engine without offloading.

What the engine submitted (jobs, blocks and bytes per job, jobs per second, submit time,
threads, failures, and offload-core's per-lane stats with the mechanisms ``auto`` chose) is
noted by `recording_spec`, which wraps both specs' workers the same way. ``offload-core:MECH``
is offload-core's spec with the cuda backend forced to one mechanism (``OFFLOAD_CORE_CUDA_CONF``).

The model is a Llama of the shape asked for, with dummy weights drawn again as a random
network (``N(0, 1/fan_in)``; vLLM's dummy weights are so small that every token ties) so that
every token depends on the KV bytes it attends to; prompts are token ids, so nothing is
downloaded.

    python benchmarks/vllm/serve.py [--shapes llama8b,small] [--host-blocks 16,64]
        [--specs offload-core,vllm-cpu,off,offload-core:ce_batch] [--iters 10] [--rounds 1] [--phases latency,mix,decode] [--graphs]
        [--out DIR] [--report-only]

Writes DIR/results.json (every run's figures), DIR/report.md (the tables) and a log per run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# Llama-shaped models. Page = 16 tokens x KV heads x head dim x 2 bytes (bf16), per layer and K or V.
SHAPES = {
    "llama8b": {  # Llama-3.1-8B: 32 KiB pages, 2 MiB per 16-token block over all layers
        "config": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=32768,
        ),
        "gpu_blocks": 3072,  # 48k tokens (6 GiB) of GPU KV cache: the mix's prefixes do not fit
        "cpu_bytes": 16 * 10**9,
    },
    "small": {  # 2 KV heads of 64: 4 KiB pages, 128 KiB per block over 16 layers
        "config": dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=32000,
            max_position_embeddings=32768,
        ),
        "gpu_blocks": 3072,
        "cpu_bytes": 2 * 10**9,
    },
}
SPECS = {
    "offload-core": "RecordingOffloadCoreSpec",
    "vllm-cpu": "RecordingCPUSpec",
    "off": None,
}
PROMPT_LEN = 10241  # 10240 tokens: whole 16- and 64-token blocks, plus the one token every hit recomputes
GEN_TOKENS = 8  # greedy tokens compared between the GPU hit and the host hit
MIX = dict(prefixes=12, prefix_len=6144, suffix_len=256, requests=48, out_tokens=64, concurrency=8)
DECODE = dict(requests=16, prompt_len=2048, out_tokens=64)
# The engine's steps while the prompts are stored (the first 8 that decode only: the prompts'
# stores start as their prefill ends) and once the stores are long done (the last 24): their
# ratio, set against the engine without offloading, cancels what makes one engine faster than
# another (its GPU's clocks, its process) and leaves what the stores cost the decode
DECODE_EARLY, DECODE_LATE = 8, 24
PHASES = ("latency", "mix", "decode")
GRAPHS = dict(mode=0, cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=[1, 2, 4, 8, 16])


# ---------------------------------------------------------------------------------------------
# the child: one engine


def _random_weights(model) -> int:
    """Runs in vLLM's worker (``LLM.apply_model``): a random network whose tokens depend on the KV."""
    import torch

    g = torch.Generator(device=next(model.parameters()).device)
    g.manual_seed(0)
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
            else:
                p.fill_(1.0)  # norms
            n += 1
    return n


def _jobs_summary(worker) -> dict:
    """Runs in vLLM's worker (``LLM.collective_rpc``)."""
    import recording_spec

    return recording_spec.summary()


def _jobs_reset(worker) -> None:
    import recording_spec

    recording_spec.reset()


def _one(llm, prompt, params):
    from vllm import TokensPrompt

    t0 = time.perf_counter()
    [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    m = out.metrics
    c = out.outputs[0]
    lp = [float(next(iter(d.values())).logprob) if d else None for d in (c.logprobs or [])]
    return {
        "ttft": float(m.first_token_latency) if m is not None else wall,
        "wall": wall,
        "tokens": list(c.token_ids),
        "logprobs": lp,
        "cached": out.num_cached_tokens,
    }


def _wait_reset(llm, timeout=30.0) -> int:
    """vLLM's ``_wait_for_prefix_cache_reset``: retry until the stores are done, stepping the
    engine with a one-token request between tries so that it polls the worker."""
    from vllm import SamplingParams, TokensPrompt

    tries = 0
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        tries += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"reset_prefix_cache did not succeed within {timeout} s")
        llm.generate(
            [TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False
        )
    return tries


def latency(llm, cfg, vocab: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False)
    rng = np.random.default_rng(1)
    host_block = cfg["host_block"]
    expect_cached = (PROMPT_LEN - 1) // host_block * host_block
    rows = []
    for i in range(cfg["iters"] + 1):  # the first is a warm-up
        prompt = rng.integers(10, vocab, PROMPT_LEN).tolist()  # a new prompt: cold on the GPU and the host
        row = {"cold": _one(llm, prompt, params), "gpu_hit": _one(llm, prompt, params)}
        if cfg["spec"] != "off":
            row["reset_tries"] = _wait_reset(llm)
            row["host_hit"] = _one(llm, prompt, params)
        if i:
            rows.append(row)
    out = {"iters": len(rows), "prompt_len": PROMPT_LEN}
    for k in ("cold", "gpu_hit", "host_hit"):
        if rows and k in rows[0]:
            t = np.array([r[k]["ttft"] for r in rows]) * 1e3
            out[k] = {"ttft_ms_median": float(np.median(t)), "ttft_ms": [round(float(x), 2) for x in t]}
    if cfg["spec"] != "off":
        h = [r["host_hit"] for r in rows]
        g = [r["gpu_hit"] for r in rows]
        out["host_below_cold"] = sum(r["host_hit"]["ttft"] < r["cold"]["ttft"] for r in rows)
        out["tokens_equal"] = sum(a["tokens"] == b["tokens"] for a, b in zip(h, g))
        out["logprobs_equal"] = sum(a["logprobs"] == b["logprobs"] for a, b in zip(h, g))
        out["host_hits_whole"] = sum((r["cached"] or 0) >= expect_cached for r in h)
        out["host_cached_tokens"] = [r["cached"] for r in h]
        out["expected_cached"] = expect_cached
        out["reset_tries"] = [r["reset_tries"] for r in rows]
        out["distinct_first_tokens"] = len({r["gpu_hit"]["tokens"][0] for r in rows})
    return out


def _drive(llm, prompts, params, concurrency: int, steps: list | None = None) -> tuple[list, float]:
    """Keep `concurrency` requests in flight until every prompt has finished (a closed loop);
    `steps`, if given, gets the time each engine step came back (vLLM 0.33's `LLM.enqueue`
    asks for final outputs only: most steps return none)."""
    from vllm import TokensPrompt

    engine = llm.llm_engine
    todo = list(prompts)
    in_flight, outs = 0, []
    t0 = time.perf_counter()
    while todo or engine.has_unfinished_requests():
        while todo and in_flight < concurrency:
            llm.enqueue([TokensPrompt(prompt_token_ids=todo.pop(0))], params, use_tqdm=False)
            in_flight += 1
        out = engine.step()
        if steps is not None:
            steps.append(time.perf_counter())
        for o in out:
            if o.finished:
                outs.append(o)
                in_flight -= 1
    return outs, time.perf_counter() - t0


def _tpot_ms(outs) -> np.ndarray:
    t = []
    for o in outs:
        m = o.metrics
        if m is not None and m.num_generation_tokens > 1:
            t.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
    return np.array(t) * 1e3


def mix(llm, vocab: int) -> dict:
    from vllm import SamplingParams

    rng = np.random.default_rng(2)
    prefixes = [rng.integers(10, vocab, MIX["prefix_len"]).tolist() for _ in range(MIX["prefixes"])]
    params = SamplingParams(max_tokens=MIX["out_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)

    def request(p):
        return prefixes[p] + rng.integers(10, vocab, MIX["suffix_len"]).tolist()

    # Warm: every prefix once, as a server that has seen them (the host then holds them all).
    _drive(llm, [request(p) for p in range(MIX["prefixes"])], params, MIX["concurrency"])
    order = rng.integers(0, MIX["prefixes"], MIX["requests"])
    prompts = [request(int(p)) for p in order]
    outs, wall = _drive(llm, prompts, params, MIX["concurrency"])
    ttft = np.array([o.metrics.first_token_latency for o in outs if o.metrics is not None]) * 1e3
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    tpot = _tpot_ms(outs)
    return {
        **MIX,
        "wall_s": wall,
        "requests_per_s": len(outs) / wall,
        "output_tokens_per_s": len(outs) * MIX["out_tokens"] / wall,
        "prompt_tokens_per_s": prompt_tokens / wall,
        "cached_fraction": cached / prompt_tokens,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p90": float(np.percentile(ttft, 90)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "tpot_ms_median": float(np.median(tpot)) if tpot.size else None,
    }


def step_ms(steps: list[float]) -> tuple[float, float]:
    """The median milliseconds of the first `DECODE_EARLY` steps that decode only and of the
    last `DECODE_LATE`, from the times (seconds) each engine step returned."""
    gaps = np.diff(steps) * 1e3
    late = float(np.median(gaps[-DECODE_LATE:]))
    first = int(np.argmax(gaps < 2 * late))  # the first step that decodes only: prefill steps are longer
    return float(np.median(gaps[first : first + DECODE_EARLY])), late


def decode(llm, vocab: int) -> dict:
    from vllm import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, vocab, DECODE["prompt_len"]).tolist() for _ in range(DECODE["requests"])]
    params = SamplingParams(max_tokens=DECODE["out_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    steps: list[float] = []  # when each engine step returned
    outs, wall = _drive(llm, prompts, params, DECODE["requests"], steps)
    tpot = _tpot_ms(outs)
    early, late = step_ms(steps)
    return {
        **DECODE,
        "wall_s": wall,
        "tpot_ms_median": float(np.median(tpot)),
        "tpot_ms_p90": float(np.percentile(tpot, 90)),
        "step_ms_early": early,
        "step_ms_late": late,
        "early_over_late": early / late,
    }


def child(cfg: dict) -> dict:
    import torch
    from transformers import LlamaConfig
    from vllm import LLM
    from vllm.config import KVTransferConfig

    shape = SHAPES[cfg["shape"]]
    model_dir = tempfile.mkdtemp(prefix="vllm-serve-model-")
    # without architectures vLLM resolves the bare LlamaModel, a pooling model that cannot generate
    LlamaConfig(**shape["config"], architectures=["LlamaForCausalLM"], tie_word_embeddings=False).save_pretrained(
        model_dir
    )
    kv_transfer = None
    if cfg["spec"] != "off":
        extra = {
            "spec_name": SPECS[cfg["spec"].partition(":")[0]],
            "spec_module_path": "recording_spec",
            "cpu_bytes_to_use": shape["cpu_bytes"],
        }
        if cfg["host_block"] != 16:
            extra["block_size"] = cfg["host_block"]
        kv_transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        # eager steps are bound by the host, whose speed on a VM drifts between engines; with
        # --graphs the decode replays CUDA graphs (no torch.compile), so its steps are the GPU's
        enforce_eager=not cfg.get("graphs"),
        compilation_config=GRAPHS if cfg.get("graphs") else None,
        dtype="bfloat16",
        max_model_len=16384,
        num_gpu_blocks_override=shape["gpu_blocks"],
        gpu_memory_utilization=0.6,
        kv_transfer_config=kv_transfer,
        disable_log_stats=False,  # the requests' metrics (TTFT, token times)
        seed=0,
    )
    result: dict = {"startup_s": time.perf_counter() - t0, "gpu": torch.cuda.get_device_name()}
    try:
        result["weights"] = f"random N(0, 1/fan_in), {llm.apply_model(_random_weights)[0]} tensors"
    except Exception as exc:  # the comparison still runs, with vLLM's dummy weights (tokens tie more)
        result["weights"] = f"vLLM's dummy weights ({type(exc).__name__}: {exc})"
    vocab = shape["config"]["vocab_size"]
    for name, phase in (
        ("latency", lambda: latency(llm, cfg, vocab)),
        ("mix", lambda: mix(llm, vocab)),
        ("decode", lambda: decode(llm, vocab)),
    ):
        if name not in cfg.get("phases", PHASES):
            continue
        if cfg["spec"] != "off":
            llm.collective_rpc(_jobs_reset)
        t = time.perf_counter()
        try:
            result[name] = phase()
        except Exception as exc:
            import traceback

            result[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        result[name]["phase_s"] = time.perf_counter() - t
        if cfg["spec"] != "off":
            result[name]["jobs"] = llm.collective_rpc(_jobs_summary)[0]
        print(
            f"[{cfg['name']}] {name}: {json.dumps({k: v for k, v in result[name].items() if k != 'jobs'})[:600]}",
            flush=True,
        )
    llm.llm_engine.engine_core.shutdown()
    return result


# ---------------------------------------------------------------------------------------------
# the parent: every engine in a process of its own, then the report


def _forced(env: dict, spec: str) -> dict:
    """`env` for a child of `spec`: ``offload-core:MECH`` forces the cuda backend to MECH, the
    rest of the caller's ``OFFLOAD_CORE_CUDA_CONF`` kept."""
    _, _, mechanism = spec.partition(":")
    if not mechanism:
        return env
    conf = ",".join(p for p in (env.get("OFFLOAD_CORE_CUDA_CONF", ""), f"mechanism:{mechanism}") if p)
    return dict(env, OFFLOAD_CORE_CUDA_CONF=conf)


def _known_spec(spec: str) -> bool:
    """A name of `SPECS`, or ``offload-core:MECH`` with MECH one of the cuda backend's mechanisms."""
    name, colon, mechanism = spec.partition(":")
    if not colon:
        return name in SPECS
    from offload_core.backends.cuda.blocks import TABLE

    return name == "offload-core" and mechanism in TABLE


def runs(args) -> list[dict]:
    """The engines to run, in order. With ``--rounds N`` each shape's engines run N times, the
    order reversed every other round: engines of one machine differ from run to run (a first
    engine pays cold caches), so each spec's rounds surround the others'."""
    out = []
    for shape in args.shapes:
        for r in range(args.rounds):
            for hb in args.host_blocks:
                specs = args.specs if r % 2 == 0 else args.specs[::-1]
                for spec in specs:
                    if spec == "off" and hb != args.host_blocks[0]:
                        continue  # without offloading the host block changes nothing
                    name = (
                        f"{shape}-{spec.replace(':', '-')}"
                        + (f"-hb{hb}" if spec != "off" else "")
                        + (f"-r{r}" if args.rounds > 1 else "")
                    )
                    cfg = {
                        "name": name,
                        "shape": shape,
                        "spec": spec,
                        "host_block": hb,
                        "iters": args.iters,
                        "round": r,
                        "phases": args.phases,
                        "graphs": args.graphs,
                    }
                    out.append(cfg)
    return out


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def report(results: dict) -> str:
    meta = results.get("meta", {})
    lines = [
        f"GPU: {meta.get('gpu', '?')}; vLLM {meta.get('vllm', '?')}, torch {meta.get('torch', '?')}; "
        f"commit {meta.get('commit', '?')}; {meta.get('date', '?')}",
        "",
        "| run | startup s | cold TTFT ms | GPU hit ms | host hit ms | host < cold | tokens equal | logprobs equal "
        "| whole host hits | mix req/s | mix TTFT p50/p90/p99 ms | mix cached | mix TPOT ms | decode TPOT ms | decode steps early/late ms | failed jobs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        res = r.get("result") or {}
        if "error" in res and "latency" not in res:
            lines.append(f"| {r['name']} | failed: {res['error'][:120]} |")
            continue
        la, mx, de = res.get("latency", {}), res.get("mix", {}), res.get("decode", {})
        n = la.get("iters", 0)
        failed = sum(
            (res.get(p, {}).get("jobs") or {}).get("results", {}).get("failed", 0) for p in ("latency", "mix", "decode")
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    r["name"],
                    _fmt(res.get("startup_s")),
                    _fmt(la.get("cold", {}).get("ttft_ms_median")),
                    _fmt(la.get("gpu_hit", {}).get("ttft_ms_median")),
                    _fmt(la.get("host_hit", {}).get("ttft_ms_median")),
                    f"{la['host_below_cold']}/{n}" if "host_below_cold" in la else "-",
                    f"{la['tokens_equal']}/{n}" if "tokens_equal" in la else "-",
                    f"{la['logprobs_equal']}/{n}" if "logprobs_equal" in la else "-",
                    f"{la['host_hits_whole']}/{n}" if "host_hits_whole" in la else "-",
                    _fmt(mx.get("requests_per_s"), 2),
                    "/".join(_fmt(mx.get(f"ttft_ms_p{p}"), 0) for p in (50, 90, 99)),
                    _fmt(mx.get("cached_fraction"), 2),
                    _fmt(mx.get("tpot_ms_median"), 2),
                    _fmt(de.get("tpot_ms_median"), 2),
                    f"{_fmt(de.get('step_ms_early'), 2)}/{_fmt(de.get('step_ms_late'), 2)}",
                    str(failed) if r["spec"] != "off" else "-",
                ]
            )
            + " |"
        )
        for p in ("latency", "mix", "decode"):
            if isinstance(res.get(p), dict) and "error" in res[p]:
                lines.append(f"| {r['name']} {p} failed: {res[p]['error'][:200]} |")
    lines += ["", "What the engine submitted (per phase and direction):", ""]
    lines += [
        "| run | phase | dir | jobs | expedited | blocks/job (histogram) | MiB/job median | jobs/s | submit us p50/p99 "
        "| seen after ms p50/p99 | engine thread ms | threads | mechanisms (offload-core) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        res = r.get("result") or {}
        for p in ("latency", "mix", "decode"):
            jobs = (res.get(p) or {}).get("jobs") if isinstance(res.get(p), dict) else None
            if not jobs:
                continue
            stats = jobs.get("offload_core_stats", {})
            for d, j in jobs.get("directions", {}).items():
                mech = {}
                for lane in [d] if d == "store" else ["load", "expedited_load"]:
                    for k, v in (stats.get(lane, {}).get("mechanisms") or {}).items():
                        mech[k] = mech.get(k, 0) + v
                hist = " ".join(f"{k}:{v}" for k, v in j["blocks_hist"].items())
                lines.append(
                    f"| {r['name']} | {p} | {d} | {j['jobs']} | {j['expedited']} | {hist} | {j['bytes_median'] / 2**20:.2f} "
                    f"| {_fmt(j['jobs_per_s'], 0)} | {j['submit_us_median']:.0f}/{j['submit_us_p99']:.0f}{_slowest(j)} "
                    f"| {_fmt(j.get('done_ms_median'))}/{_fmt(j.get('done_ms_p99'))} | {_fmt(jobs.get('engine_thread_ms'))} "
                    f"| {j['threads']} "
                    f"| {' '.join(f'{k}:{v}' for k, v in mech.items()) or '-'} |"
                )
    lines += _medians(results["runs"])
    return "\n".join(lines) + "\n"


def _slowest(j: dict) -> str:
    """The slowest submit of a direction: its milliseconds, blocks and place among the jobs."""
    top = (j.get("slowest") or [None])[0]
    return f" (max {top['submit_ms']:.1f} ms: {top['blocks']} blocks, job {top['index']})" if top else ""


def _medians(runs: list[dict]) -> list[str]:
    """Per shape, spec and host block, the median over rounds of the figures that vary from
    engine to engine (empty with one round)."""
    groups: dict = {}
    for r in runs:
        res = r.get("result") or {}
        if "latency" in res or "mix" in res:
            key = (r["shape"], r["spec"], r["host_block"] if r["spec"] != "off" else None)
            groups.setdefault(key, []).append(res)
    if not any(len(g) > 1 for g in groups.values()):
        return []
    picks = (
        ("host hit ms", ("latency", "host_hit", "ttft_ms_median")),
        ("mix req/s", ("mix", "requests_per_s")),
        ("mix TTFT p50 ms", ("mix", "ttft_ms_p50")),
        ("mix TPOT ms", ("mix", "tpot_ms_median")),
        ("decode TPOT ms", ("decode", "tpot_ms_median")),
        ("decode early/late steps", ("decode", "early_over_late")),
    )

    def get(res, path):
        for k in path:
            res = res.get(k) if isinstance(res, dict) else None
        return res

    lines = ["", "Median over rounds (each round's figure in brackets):", ""]
    lines += ["| shape | spec | host block | rounds | " + " | ".join(n for n, _ in picks) + " |"]
    lines += ["|---|---|---|---|" + "---|" * len(picks)]
    for (shape, spec, hb), rs in groups.items():
        cells = []
        for _, path in picks:
            v = [x for x in (get(res, path) for res in rs) if x is not None]
            nd = 2 if "req" in path[-1] or "tpot" in path[-1] or "over" in path[-1] else 1
            cells.append(f"{_fmt(float(np.median(v)), nd)} [{', '.join(_fmt(x, nd) for x in v)}]" if v else "-")
        lines.append(f"| {shape} | {spec} | {hb or '-'} | {len(rs)} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama8b,small", type=lambda s: s.split(","))
    ap.add_argument("--host-blocks", default="16,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--specs", default="offload-core,vllm-cpu,off", type=lambda s: s.split(","))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--phases", default=",".join(PHASES), type=lambda s: s.split(","), help="of latency,mix,decode")
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of each shape's engines, the order reversed every other"
    )
    ap.add_argument("--graphs", action="store_true", help="decode by CUDA graphs (FULL_DECODE_ONLY), not eagerly")
    ap.add_argument("--out", default="vllm-serve")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per engine")
    ap.add_argument("--budget", type=int, default=0, help="seconds for every engine together (0: no limit)")
    ap.add_argument("--report-only", action="store_true", help="rebuild report.md from OUT/results.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        cfg = json.loads(args.child)
        res = child(cfg)
        Path(cfg["result"]).write_text(json.dumps(res))
        os._exit(0)  # vLLM's engine processes go with us; nothing left to tear down
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    if args.report_only:
        (out / "report.md").write_text(report(json.loads(path.read_text())))
        return
    for s in args.shapes + args.specs:
        if s not in SHAPES and not _known_spec(s):
            ap.error(
                f"unknown shape or spec {s!r}: shapes {list(SHAPES)}, specs {list(SPECS)} or offload-core:MECHANISM"
            )
    if not set(args.phases) <= set(PHASES):
        ap.error(f"unknown phase in {args.phases}: phases {list(PHASES)}")
    results = {"meta": _meta(), "runs": []}
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # apply_model and collective_rpc take functions
    # greedy sampling needs no FlashInfer, which vLLM otherwise imports to probe (the GPU bundle has none)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    end = time.perf_counter() + (args.budget or 1e9)
    missing = None  # a module the environment lacks fails every engine alike: the rest are skipped
    for cfg in runs(args):
        cfg["result"] = str(out / f"{cfg['name']}.json")
        t = time.perf_counter()
        if end - t < 60 or missing:
            why = f"skipped: {missing}" if missing else "skipped: --budget spent"
            results["runs"].append({**cfg, "rc": "skipped", "result": {"error": why}})
            continue
        with open(out / f"{cfg['name']}.log", "w") as log:
            # a session of its own: whatever the engine leaves (its core process) goes with it
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", json.dumps(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_forced(env, cfg["spec"]),
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=min(args.timeout, end - t))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if Path(cfg["result"]).exists():
            res = json.loads(Path(cfg["result"]).read_text())
        else:
            found = re.findall(
                r"ModuleNotFoundError: No module named '[^']+'", (out / f"{cfg['name']}.log").read_text()
            )
            missing = found[-1] if found else None
            res = {"error": f"rc={rc}" + (f" ({missing})" if missing else "")}
        results["meta"]["gpu"] = res.get("gpu", results["meta"].get("gpu"))
        results["runs"].append({**cfg, "rc": rc, "seconds": time.perf_counter() - t, "result": res})
        path.write_text(json.dumps(results, indent=1))
        print(f"== {cfg['name']}: rc={rc} in {time.perf_counter() - t:.0f} s", flush=True)
    (out / "report.md").write_text(report(results))
    print(report(results))


def _meta() -> dict:
    meta = {"date": time.strftime("%Y-%m-%d"), "host": platform.node()}
    try:  # not through torch: a CUDA context here would hold GPU memory the engines need
        smi = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        meta["gpu"] = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch
        import vllm

        meta.update(vllm=vllm.__version__, torch=torch.__version__)
    except Exception as exc:
        meta["import_error"] = repr(exc)
    meta["commit"] = (
        os.environ.get("COMMIT")
        or subprocess.run(["git", "log", "-1", "--format=%h"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    )
    return meta


if __name__ == "__main__":
    main()
