"""A character-level tokenizer with a chat template, built locally with `tokenizers` (no hub access).

    tok = build_tokenizer("out/")            # writes tokenizer.json, tokenizer_config.json, chat_template.jinja
    AutoTokenizer.from_pretrained("out/")    # loads it back

Ids: the special tokens first (<pad>=0, <bos>=1, <eos>=2, <unk>=3, <|system|>, <|user|>, <|assistant|>), then one
token per printable ASCII character plus newline. Anything else encodes as <unk>.
"""
from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *ROLE_TOKENS.values()]
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"

# <bos><|system|>...\n<|user|>...\n<|assistant|>...<eos>  and, with add_generation_prompt, a trailing <|assistant|>;
# a tool's result (role tool, multi-turn rollouts) is a user line <|user|><tool_response>...</tool_response>\n
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role ' ~ message['role'] ~ ' (expected system, user, assistant or tool)') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'tool' %}{{ '<|user|><tool_response>' ~ message['content'] ~ '</tool_response>' }}"
    "{%- else %}{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tokenizer_vocab() -> dict[str, int]:
    tokens = [*SPECIAL_TOKENS, *CHARACTERS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer as a transformers fast tokenizer; saved to `out_dir` when given."""
    core = Tokenizer(models.WordLevel(tokenizer_vocab(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    core.decoder = decoders.Fuse()  # join characters back without spaces
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                  additional_special_tokens=list(ROLE_TOKENS.values()))
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 1 << 20
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out_dir))
    return tok


def _model_folder_hint(folder: Path) -> str:
    """Where the model folder is, when `folder` is a run directory or one of its checkpoints."""
    if (folder / "hf" / "config.json").is_file():
        return f"; the run directory's HF export is {folder / 'hf'}"
    if (folder / "meta.json").is_file() or (folder / "latest").is_file():
        return (f"; {folder} holds a training checkpoint: `moeloop ckpt export {folder} --model <that run's "
                f"model.path> --out DIR` writes a model folder from it")
    return ""


def load_folder_tokenizer(model_dir: str | Path, what: str):
    """The tokenizer of the model folder `model_dir` (`what` names it in errors: a config field or a flag).

    Each an InputError: no config.json there, a config.json that does not parse (`ModelConfig.from_pretrained` reads
    it first: transformers would raise an OSError), and a tokenizer with no vocabulary. Without tokenizer files
    transformers builds an empty tokenizer from the model type alone, and every prompt then encodes to no tokens
    (which an error about an empty prompt would report, far from the cause)."""
    from transformers import AutoTokenizer

    from moeloop.errors import InputError
    from moeloop.model.config import ModelConfig
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise InputError(f"{what}={model_dir}: no model folder there (config.json, safetensors and tokenizer files, as "
                         f"`moeloop init-model` or an SFT run's HF export writes){_model_folder_hint(folder)}")
    ModelConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if len(tokenizer) < 2:
        raise InputError(f"{what}={model_dir}: its tokenizer has {len(tokenizer)} token(s): no tokenizer files there "
                         f"(tokenizer.json, or the vocabulary files of a slow tokenizer)?")
    return tokenizer
