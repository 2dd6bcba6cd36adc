"""Where the host time of serving goes: `bench serve --null-model` (runtime/null.py: a model that
costs nothing) with cProfile on each of the server's threads (the engine loop, uvicorn's event
loop), one case; the load generator in a process of its own (``--client-here``: in this one,
profiled too).

  PYTHONPATH=$PWD python benchmarks/profile_serve_host.py --concurrency 64 --output-len 128 --top 25

Prints, per thread, its CPU seconds, the engine's steps and tokens, and the top functions by
their own time (tottime) and by cumulative time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--client-here", action="store_true", help="the load generator in this process (profiled)")
    args = ap.parse_args()

    from gptoss_fp8.bench import serve as bs
    from gptoss_fp8.runtime import engine as eng
    from gptoss_fp8.serve import server as srv

    profiles: dict[str, cProfile.Profile] = {}
    cpu: dict[str, float] = {}

    def profiled(name, fn):
        def run(*a, **k):
            p = profiles[name] = cProfile.Profile()
            t0 = time.thread_time()
            p.enable()
            try:
                return fn(*a, **k)
            finally:
                p.disable()
                cpu[name] = time.thread_time() - t0
        return run

    eng.EngineThread._loop = profiled("engine", eng.EngineThread._loop)
    served = srv.build_null(max_batch=args.concurrency, max_context=args.prompt_len + args.output_len + 1,
                            step_ms=args.step_ms, echo=print)
    server = srv.Server(served)
    server.thread = threading.Thread(target=profiled("http", server.uvicorn.run), daemon=True)
    server.start()
    n = args.requests or max(8, 2 * args.concurrency)
    steps0 = served.engine.metrics.steps
    if args.client_here:  # the load generator in this process, profiled too (bench serve did so before)
        client = cProfile.Profile()
        t0c = time.thread_time()
        client.enable()
        timings, t0, t1 = asyncio.run(bs._case(server.url, "null", args.prompt_len, args.concurrency, n,
                                               args.output_len, 201088, 0, None))
        wall = t1 - t0
        client.disable()
        profiles["client"], cpu["client"] = client, time.thread_time() - t0c
    else:  # in a process of its own, as bench serve runs it
        timings, wall = bs.run_case(server.url, "null", args.prompt_len, args.concurrency, n, args.output_len,
                                    201088, 0, None, bs.client_procs(args.concurrency))
    steps = served.engine.metrics.steps - steps0
    server.stop()
    row = bs.summarize(timings, wall, prompt_len=args.prompt_len, concurrency=args.concurrency)
    toks = row["output_tokens"]
    print(f"c={args.concurrency}: {toks} tokens in {wall:.2f} s = {row['tokens_per_s']:.0f} tok/s, {steps} steps "
          f"= {steps / wall:.0f} steps/s ({toks / max(steps, 1):.1f} tokens/step), ITL p50 {row['itl_p50_ms']:.2f} ms")
    for name in [k for k in ("engine", "http", "client") if k in profiles]:
        c = cpu.get(name, float("nan"))
        print(f"\n=== {name}: {c:.2f} CPU s = {1e3 * c / max(steps, 1):.2f} ms per step, "
              f"{1e6 * c / max(toks, 1):.0f} us per token")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(profiles[name], stream=s).sort_stats(key).print_stats(args.top)
            print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip())[:20000])


if __name__ == "__main__":
    main()
