import subprocess
import sys


def run_cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "raypaged.entrypoints.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_chat_answers_on_the_default_model(smollm2_dir):
    result = run_cli(
        "generate",
        "--model",
        str(smollm2_dir),
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "1024",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "20",
    )
    assert result.returncode == 0, result.stderr
    assert "### prompt: What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout
    assert "finish_reason=stop" in result.stdout


def test_prompts_from_stdin_and_debug_step_logs(smollm2_dir):
    result = run_cli(
        "generate",
        "--model",
        str(smollm2_dir),
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "1024",
        "--max-tokens",
        "3",
        "--log-level",
        "debug",
        stdin="Hello there\nThe sky is\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("### 3 tokens, finish_reason=length") == 2
    assert "step: " in result.stderr and "blocks used=" in result.stderr


def test_bad_flag_values_exit_with_a_message(smollm2_dir):
    result = run_cli("generate", "--model", str(smollm2_dir), "--max-model-len", "9000", "--prompt", "x")
    assert result.returncode == 2
    assert "error: max_model_len 9000 exceeds the model's max_position_embeddings 8192" in result.stderr


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_flag_errors_exit_with_a_message(smollm2_dir):
    result = run_cli("serve", "--model", str(smollm2_dir), "--served-model-name", "a", "--served-model-name", "b")
    assert result.returncode == 2
    assert "error: give one --served-model-name per --model (1 models, 2 names), or none" in result.stderr
    result = run_cli("gateway", "--engine", "no-address")
    assert result.returncode == 2
    assert "error: --engine takes NAME=host:port, got 'no-address'" in result.stderr
