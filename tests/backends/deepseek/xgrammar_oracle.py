"""Runs in the DeepInfer harness interpreter: DeepInfer 0.1.0's own structured-output code, on xgrammar 0.2.2.

``python xgrammar_oracle.py TOKENIZER_JSON VOCAB_SIZE`` reads one JSON request per line on stdin and answers one
JSON line each. A request is ``{"so_args": {...}, "texts": [[token ids], ...], "mask": bool}``: the ``so_args``
are compiled by DeepInfer's ``SOMatcherBuilder`` (``compile_json_schema(strict_mode=True)``, ``compile_regex``,
``compile_grammar``, as its engine does), and each text is fed token by token to a fresh ``XGrammarMatcher`` of
it, then EOS. The answer: ``error`` (the builder's abort message, or null), ``compile_ms``, ``accepted`` (each
text taken whole, EOS included), ``rejected_at`` (the index of the first refused token, the text's length for
a refused EOS, -1 when accepted) and, with ``mask``, ``mask_us`` (mean time of ``fill_vocab_mask`` per token).
"""

from __future__ import annotations

import json
import sys
import time

from deepinfer.structure_output.matcher import allocate_vocab_mask
from deepinfer.structure_output.so_matcher_builder import SOMatcherBuilder
from transformers import PreTrainedTokenizerFast

EOS = 1


def main() -> None:
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=sys.argv[1])
    vocab_size = int(sys.argv[2])
    builder = SOMatcherBuilder(tokenizer, vocab_size, EOS)
    mask = allocate_vocab_mask(1, vocab_size, pin_memory=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        compiled = builder.build(request["so_args"]).result()
        compile_ms = (time.perf_counter() - started) * 1000
        if compiled.is_aborted():
            print(json.dumps({"error": compiled.aborted_msg, "compile_ms": compile_ms}), flush=True)
            continue
        accepted, rejected_at, mask_seconds, masked = [], [], 0.0, 0
        for text in request["texts"]:
            matcher = compiled.copy_without_status()
            at = -1
            for i, token in enumerate([*text, EOS]):
                if request.get("mask"):
                    tick = time.perf_counter()
                    matcher.fill_vocab_mask(mask, 0)
                    mask_seconds += time.perf_counter() - tick
                    masked += 1
                if not matcher.accept_token(token):
                    at = i
                    break
            accepted.append(at < 0)
            rejected_at.append(at)
        answer = {"error": None, "compile_ms": compile_ms, "accepted": accepted, "rejected_at": rejected_at}
        if masked:
            answer["mask_us"] = mask_seconds / masked * 1e6
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
