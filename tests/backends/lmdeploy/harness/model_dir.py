"""A tiny Hugging Face model directory without weights: what LMDeploy's api_server needs to start on a stub engine.

A small byte-level BPE tokenizer (trained here, deterministically, on a few sentences), a ChatML chat template, a
Llama ``config.json`` whose ``max_position_embeddings`` is the default session length, and the EOS ids in
``generation_config.json``. The directory name stays neutral: LMDeploy picks chat templates by path name first.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # single tokens the parsers need, kept in text
VOCAB_SIZE = 640

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "one two three four five six seven eight nine ten",
    "The answer is forty two. Let me think about the weather in Paris.",
    'Sure. {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Say something about files, modules, streams and the gateway.",
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda",
    "STOP here and END there, then go on: red green blue.",
]

# ChatML. Newlines are explicit '\n' strings so Jinja whitespace control cannot eat them.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' }}{{ tools | tojson }}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tokenizer


def write_model_dir(path: Path, *, max_position_embeddings: int = 512) -> Path:
    """Writes the directory (idempotent) and returns it."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS)
    im_end_id = tokenizer.token_to_id(IM_END)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOS,
        "unk_token": None,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "special": t in SPECIAL_TOKENS}
            for t in SPECIAL_TOKENS + TAG_TOKENS
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": IM_END, "pad_token": EOS}))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": tokenizer.get_vocab_size(),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "float16",
        "bos_token_id": None,
        "eos_token_id": [im_end_id, eos_id],
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end_id, eos_id]}))
    return path
