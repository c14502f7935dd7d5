"""The cap on the V2 model runner (GPU only: it needs CUDA and Triton).

Runs a short ``vllm.LLM`` script in a subprocess (the engine core is a spawned process, so the
script needs its ``__main__`` guard) and checks what only the V2 runner does:

* plain ``prompt_logprobs``: rows come back by absolute position after a cache hit
  (``runner_v2`` prepends the hit as sentinel rows), entries before S are ``None``;
* ``prompt_logprob_token_ids`` with ``prompt_logprob_start = S``: the hit stops at S and the
  fixed-id scores match the uncached ones;
* preemption under a tiny KV cache with chunked prefill (the V2 runner re-adds the request).

GPU kernels are not bit-stable across execution shapes, so rows are compared with a tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the V2 model runner needs a GPU"),
]

ATOL = 1e-3

SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    from vllm import LLM, SamplingParams
    from replicas.vllm_plugin import SCORE_START_KEY

    def rows(out, p):
        return [None if e is None else {t: [lp.logprob, lp.rank] for t, lp in e.items()}
                for e in out.prompt_logprobs[p:]], out.prompt_logprobs[:p]

    if __name__ == "__main__":
        model, result_path = sys.argv[1], sys.argv[2]
        llm = LLM(model=model, dtype="float32", block_size=16, enable_prefix_caching=True,
                  max_model_len=2560, max_num_batched_tokens=256, enable_chunked_prefill=True,
                  num_gpu_blocks_override=200, gpu_memory_utilization=0.2, max_num_seqs=16,
                  disable_log_stats=False)
        rng = random.Random(0)
        p = 2000
        ctx = [rng.randrange(5, 1000) for _ in range(p)]
        prompts = [ctx + [rng.randrange(5, 1000) for _ in range(n)] for n in (37, 80, 150, 121)]
        plain = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        capped = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                extra_args={SCORE_START_KEY: p - 1})
        res = {"ref": [], "cap": [], "cached": [], "before_s_all_none": True}
        for ids in prompts:
            out, = llm.generate([{"prompt_token_ids": ids}], plain)
            res["ref"].append(rows(out, p)[0])
        llm.reset_prefix_cache()
        for ids in prompts:
            out, = llm.generate([{"prompt_token_ids": ids}], capped)
            got, before = rows(out, p)
            res["cap"].append(got)
            res["cached"].append(out.num_cached_tokens)
            res["before_s_all_none"] &= all(e is None for e in before)
        fixed = [[[t] for t in ids[p:]] for ids in prompts]
        def token_id_params(i, s):
            kw = dict(max_tokens=1, temperature=0, prompt_logprob_token_ids=fixed[i],
                      prompt_logprob_start=p - 1)
            return SamplingParams(**kw, extra_args=None if s is None else {SCORE_START_KEY: s})
        res["tid_ref"] = [llm.generate([{"prompt_token_ids": ids}], token_id_params(i, None))[0]
                          .prompt_token_id_logprobs.tolist() for i, ids in enumerate(prompts)]
        outs = [llm.generate([{"prompt_token_ids": ids}], token_id_params(i, p - 1))[0]
                for i, ids in enumerate(prompts)]
        res["tid_cap"] = [o.prompt_token_id_logprobs.tolist() for o in outs]
        res["tid_cached"] = [o.num_cached_tokens for o in outs]
        llm.reset_prefix_cache()
        fillers = [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(600)]} for _ in range(4)]
        burst = llm.generate(fillers + [{"prompt_token_ids": ids} for ids in prompts],
                             [SamplingParams(max_tokens=1500, ignore_eos=True)] * 4 + [capped] * 4)
        res["burst"] = [rows(o, p)[0] for o in burst[4:]]
        res["preemptions"] = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        json.dump(res, open(result_path, "w"))
    """
)


def assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for tok in w:
            assert abs(g[tok][0] - w[tok][0]) <= ATOL and g[tok][1] == w[tok][1]


def test_v2_runner_scores_by_absolute_position(tmp_path):
    from replicas.tiny_model import ensure_tiny_model

    script, result = tmp_path / "v2_cap.py", tmp_path / "result.json"
    script.write_text(SCRIPT)
    subprocess.run([sys.executable, str(script), str(ensure_tiny_model()), str(result)],
                   check=True, timeout=900, env={**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1"})
    res = json.loads(result.read_text())
    assert res["before_s_all_none"]
    assert res["cached"] == [0, 1984, 1984, 1984]  # S = 1999 with 16-token blocks
    for got, want in zip(res["cap"], res["ref"]):
        assert_close(got, want)
    assert res["tid_cached"][1:] == [1984] * 3
    for got, want in zip(res["tid_cap"], res["tid_ref"]):
        assert len(got) == len(want) and all(abs(a[0] - b[0]) <= ATOL for a, b in zip(got, want))
    assert res["preemptions"] > 0
    for got, want in zip(res["burst"], res["ref"]):
        assert_close(got, want)
