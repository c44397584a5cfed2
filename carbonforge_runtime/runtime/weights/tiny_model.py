"""Builds the tiny random-weight chat model the CPU validation recipe serves.

No model hub is needed: a byte-level BPE tokenizer is trained on Python's own standard
library sources and a 0.6 M-parameter Qwen2 model is saved with a fixed seed. Output text is
random, which is all the plumbing needs. Requires the ``cpu`` extra (torch, transformers).
"""

from __future__ import annotations

import json
import os
import sysconfig
import tempfile
from pathlib import Path

from carbonforge_runtime.errors import CarbonForgeError

#: Bump when the recipe of the model changes, so stale copies are rebuilt.
TINY_MODEL_VERSION = "2"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Markup tokens of Qwen3's chat format. Plain added tokens (not special ones), so that they stay in
#: the decoded text where vLLM's reasoning and tool-call parsers look for them.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
#: A Qwen3-style template: tools listed in the system turn, calls as JSON inside <tool_call>, tool
#: results as <tool_response> in a user turn, and thinking opened in the generation prompt unless the
#: request turns it off (then an empty thinking block is rendered, as Qwen3 does).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nFunction signatures are inside <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nTo call a function, return a JSON object with its name and arguments inside "
    "<tool_call></tool_call>.<|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}"
)
_MARKER = "carbonforge-tiny-model.json"


def is_built(directory: Path) -> bool:
    marker = directory / _MARKER
    try:
        return json.loads(marker.read_text())["version"] == TINY_MODEL_VERSION
    except (OSError, ValueError, KeyError):
        return False


def _training_text(limit_bytes: int = 4_000_000) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def ensure_tiny_model(directory: Path) -> Path:
    """Build the model into ``directory`` unless it is already there; returns the directory.

    The build happens in a temporary sibling directory that is renamed into place, so an
    interrupted build never leaves a half-written model behind.
    """
    directory = directory.expanduser()
    if is_built(directory):
        return directory
    try:
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    except ImportError as exc:
        raise CarbonForgeError(
            f"the built-in tiny model needs torch and transformers ({exc.name} is missing)",
            "install the CPU engine: pip install 'carbonforge-runtime[cpu]'",
        ) from None

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=directory.parent))

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer.add_tokens(MARKUP_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    fast.save_pretrained(staging)

    eos_id = tokenizer.token_to_id("<|im_end|>")
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.to(dtype=torch.bfloat16)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(staging)
    (staging / _MARKER).write_text(json.dumps({"version": TINY_MODEL_VERSION}))

    if directory.exists():
        # A stale or partial copy: move it aside, then out of the way.
        stale = Path(tempfile.mkdtemp(prefix=".tiny-stale-", dir=directory.parent))
        os.replace(directory, stale / "old")
    staging.chmod(0o755)
    os.replace(staging, directory)
    return directory
