"""What llama.cpp makes of a GGUF file: run by benchmarks/check_gguf_llama_cpp.py with the
interpreter of .venv-llama-cpp (benchmarks/llama_cpp_env.sh), which has llama-cpp-python and
numpy and nothing of gptforge.

Reads one JSON request on stdin: {"gguf": PATH, "strings": [...], "ids": [...], "threads": N};
writes one JSON answer on stdout: the token ids llama.cpp gives each string (no BOS, special
tokens not parsed, as a Hugging Face tokenizer's `add_special_tokens=False`), and the argmax of
the next-token logits at every position of `ids` (llama.cpp's own forward, every position's
logits kept).
"""

import json
import sys


def main() -> None:
    import llama_cpp
    import numpy as np

    request = json.load(sys.stdin)
    answer = {"llama_cpp": llama_cpp.__version__}
    vocab = llama_cpp.Llama(model_path=request["gguf"], vocab_only=True, verbose=False)
    answer["token_ids"] = [vocab.tokenize(s.encode("utf-8"), add_bos=False, special=False) for s in request["strings"]]
    del vocab
    ids = request["ids"]
    if ids:
        llm = llama_cpp.Llama(
            model_path=request["gguf"],
            n_ctx=max(512, len(ids) + 8),
            n_batch=len(ids),
            n_threads=request.get("threads", 2),
            logits_all=True,
            verbose=False,
        )
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
        answer["argmax"] = scores.argmax(-1).tolist()
        answer["n_vocab"] = int(scores.shape[-1])
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
