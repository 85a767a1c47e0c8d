"""Run by a Python that has vLLM (not driftgate's): score and continue token sequences with vLLM.

`bench/vllm_interop.py` starts it as `PYTHON bench/vllm_side.py REQUEST.json RESULT.json`, so it
imports nothing of driftgate's (vLLM pins its own torch, which is why it lives in another venv).
REQUEST: {"model", "dtype", "max_model_len", "kv_cache_dtype", "sequences": [[ids]] to score,
"prompts": [[ids]] to continue greedily, "max_tokens"}. RESULT: {"prompt_logprobs": [[float]]
(each sequence's tokens after the first), "greedy": [[ids]], "kv_cache_dtype" (the cache vLLM
chose), "seconds"}. vLLM's own log goes to stdout, where the caller reads which kernels it chose.
"""

import json
import sys
import time


def main(request_path: str, result_path: str) -> None:
    from vllm import (  # the vLLM venv's; imported in main, which spawned workers do not run
        LLM,
        SamplingParams,
    )

    with open(request_path, encoding="utf-8") as f:
        request = json.load(f)
    start = time.perf_counter()
    llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              kv_cache_dtype=request["kv_cache_dtype"], enforce_eager=True, seed=0)
    scored = llm.generate([{"prompt_token_ids": ids} for ids in request["sequences"]],
                          SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    prompt_logprobs = [[entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
                       for ids, out in zip(request["sequences"], scored, strict=True)]
    greedy = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]],
                          SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True),
                          use_tqdm=False)
    result = {"prompt_logprobs": prompt_logprobs, "greedy": [list(out.outputs[0].token_ids) for out in greedy],
              "kv_cache_dtype": str(llm.llm_engine.vllm_config.cache_config.cache_dtype),
              "seconds": time.perf_counter() - start}
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
