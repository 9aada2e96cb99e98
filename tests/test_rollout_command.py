"""`moeloop generate` end to end on a tiny model folder written by the factory (model + tokenizer)."""
import json

from moeloop.cli import main as cli_main
from moeloop.model.factory import init_model


def test_generate_command_writes_completions(tmp_path, capsys):
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1="}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "o.jsonl"
    rc = cli_main(["generate", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--n", "2",
                   "--max-tokens", "5", "--temperature", "0.8", "--top-k", "10", "--seed", "3"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["prompt"] == "1+1=" and "hi" in rows[2]["prompt"]
    for r in rows:
        assert 1 <= len(r["response_token_ids"]) <= 5 and len(r["logprobs"]) == len(r["response_token_ids"])
        assert r["finish_reason"] in ("stop", "length") and isinstance(r["completion"], str)
    assert "tok/s" in capsys.readouterr().out
