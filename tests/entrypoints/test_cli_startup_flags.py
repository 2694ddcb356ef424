"""vLLM startup flags on real servers: --config, --seed, several --api-key keys, HTTPS, --root-path,
uvicorn's log flags, --max-num-partial-prefills; and the errors a user sees for each."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import time
from pathlib import Path

import grpc
import httpx
import pytest

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import ModelRunnerOutput, SampledToken
from raypaged.core.request import Request
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.entrypoints.cli import build_parser, engine_configs, main
from raypaged.sampling_params import SamplingParams
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.reliability.conftest import ServerProcess, free_port
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

ENGINE_FLAGS = ["--max-model-len", "128", "--num-gpu-blocks-override", "32"]
INCORRECT = "Incorrect API key provided; send it as 'Authorization: Bearer KEY'"
# the first sampled request of every server below: unseeded, so it draws from the engine's --seed generator
FIRST_SAMPLE = pb.GenerateRequest(
    model="tiny",
    text="Once upon a time",
    sampling=pb.SamplingParameters(temperature=1.0),
    stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True),
)
ACCESS_LINE = '"GET /v1/models HTTP/1.1" 200'


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for localhost and 127.0.0.1, its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def generate(grpc_port: int, api_key: str, request: pb.GenerateRequest = FIRST_SAMPLE) -> list[int]:
    """The token ids of one gRPC Generate call."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        responses = stub.Generate(request, metadata=(("authorization", f"Bearer {api_key}"),), timeout=120)
        return [t for response in responses for delta in response.outputs for t in delta.token_ids]


def wait_grpc_ready(server: ServerProcess, grpc_port: int, within_s: float = 180) -> None:
    deadline = time.monotonic() + within_s
    while True:
        assert server.process.poll() is None, f"server exited with {server.process.returncode}:\n{server.log()}"
        try:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                health = pb_grpc.TextGenerationServiceStub(channel).Health(pb.HealthRequest(), timeout=5)
                if health.status == pb.SERVING_STATUS_SERVING:
                    return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"engine not ready within {within_s} s:\n{server.log()}"
        time.sleep(0.2)


class Running:
    """A started server: its URLs, the tokens of its first sampled request, its process."""

    def __init__(self, process: ServerProcess, url: str, grpc_port: int, first_sample: list[int]) -> None:
        self.process, self.url, self.grpc_port, self.first_sample = process, url, grpc_port, first_sample


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def trust(certificate) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certificate[0]))


@pytest.fixture(scope="module")
def https_server(tmp_path_factory, tiny_model_dir, certificate, trust):
    """HTTPS, --seed 5, keys k1 k2 (one flag) and k3 (a second), uvicorn at debug under --log-level warning."""
    cert, key = certificate
    port, grpc_port = free_port(), free_port()
    process = ServerProcess(
        "serve",
        [
            str(tiny_model_dir),
            "--served-model-name",
            "tiny",
            *ENGINE_FLAGS,
            "--seed",
            "5",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--ssl-keyfile",
            str(key),
            "--ssl-certfile",
            str(cert),
            "--api-key",
            "k1",
            "k2",
            "--api-key",
            "k3",
            "--uvicorn-log-level",
            "debug",
            "--log-level",
            "warning",
        ],
        tmp_path_factory.mktemp("https") / "serve.log",
    )
    try:
        url = f"https://127.0.0.1:{port}"
        process.wait_http_ready(url, verify=trust)
        yield Running(process, url, grpc_port, generate(grpc_port, "k2"))
    finally:
        process.close()


@pytest.fixture(scope="module")
def config_server(tmp_path_factory, tiny_model_dir):
    """Flags from --config; the command line's --served-model-name and --port win over the file's."""
    folder = tmp_path_factory.mktemp("config")
    config = folder / "serve.yaml"
    config.write_text(
        f"model: {tiny_model_dir}\n"
        "served-model-name: [from-file, other-name]\n"
        "port: 1\n"  # the command line's port wins: this one could not be bound
        "seed: 5\n"
        "max-model-len: 128\n"
        "num_gpu_blocks_override: 32\n"  # vLLM's keys may be spelled with _ too
        "api-key: [c1, c2]\n"
        "root-path: /llm\n"
        "disable-uvicorn-access-log: true\n"
        "enable-prefix-caching: false\n"
    )
    port, grpc_port = free_port(), free_port()
    process = ServerProcess(
        "serve",
        [
            "--config",
            str(config),
            "--served-model-name",
            "tiny",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
        ],
        folder / "serve.log",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        process.wait_http_ready(url)
        yield Running(process, url, grpc_port, generate(grpc_port, "c1"))
    finally:
        process.close()


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory, tiny_model_dir):
    """``raypaged engine`` (gRPC only) with --seed 6 and keys e1 e2."""
    grpc_port = free_port()
    process = ServerProcess(
        "engine",
        [
            "--model",
            str(tiny_model_dir),
            "--served-model-name",
            "tiny",
            *ENGINE_FLAGS,
            "--seed",
            "6",
            "--grpc-port",
            str(grpc_port),
            "--api-key",
            "e1",
            "e2",
        ],
        tmp_path_factory.mktemp("engine") / "engine.log",
    )
    try:
        wait_grpc_ready(process, grpc_port)
        yield Running(process, "", grpc_port, generate(grpc_port, "e2"))
    finally:
        process.close()


def test_https_serves_with_the_given_certificate_and_only_https(https_server, trust):
    models = httpx.get(f"{https_server.url}/v1/models", headers=bearer("k1"), verify=trust, timeout=30)
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{https_server.url}/health", timeout=30)  # the system's CAs do not vouch for it
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(https_server.url.replace("https:", "http:") + "/health", timeout=30)


def test_every_api_key_is_accepted_over_http_and_grpc_and_no_other(https_server, trust):
    for key in ("k1", "k2", "k3"):
        response = httpx.get(f"{https_server.url}/v1/models", headers=bearer(key), verify=trust, timeout=30)
        assert response.status_code == 200, key
        assert len(generate(https_server.grpc_port, key)) == 16
    refused = httpx.get(f"{https_server.url}/v1/models", headers=bearer("k4"), verify=trust, timeout=30)
    assert (refused.status_code, refused.json()["error"]["message"]) == (401, INCORRECT)
    with pytest.raises(grpc.RpcError) as info:
        generate(https_server.grpc_port, "k4")
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, INCORRECT)


def test_engine_command_takes_several_keys(engine_server):
    assert len(generate(engine_server.grpc_port, "e1")) == 16
    with pytest.raises(grpc.RpcError) as info:
        generate(engine_server.grpc_port, "k1")
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, INCORRECT)


def test_seed_makes_unseeded_sampling_repeat_across_runs(https_server, config_server, engine_server):
    """Two servers started with --seed 5 (one from its --config file) sample the same tokens for the same
    first unseeded request; --seed 6 samples others."""
    assert len(https_server.first_sample) == 16
    assert config_server.first_sample == https_server.first_sample
    assert engine_server.first_sample != https_server.first_sample


def test_uvicorn_log_level_is_apart_from_log_level(https_server, trust):
    httpx.get(f"{https_server.url}/v1/models", headers=bearer("k1"), verify=trust, timeout=30)
    log = https_server.process.log()
    assert "Started server process" in log and ACCESS_LINE in log  # uvicorn at debug
    assert "HTTP gateway on" not in log  # raypaged's own info lines stay off (--log-level warning)


def test_config_file_flags_apply_and_the_command_line_wins(config_server):
    models = httpx.get(f"{config_server.url}/v1/models", headers=bearer("c2"), timeout=30).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 128)]
    refused = httpx.get(f"{config_server.url}/v1/models", headers=bearer("k1"), timeout=30)
    assert refused.status_code == 401


def test_root_path_routes_with_and_without_the_prefix(config_server):
    for path in ("/llm/v1/models", "/v1/models"):
        response = httpx.get(config_server.url + path, headers=bearer("c1"), timeout=30)
        assert [m["id"] for m in response.json()["data"]] == ["tiny"], path
    for path in ("/llm/health", "/llm/metrics"):  # exempt from keys under the prefix too
        assert httpx.get(config_server.url + path, timeout=30).status_code == 200, path
    refused = httpx.get(config_server.url + "/llm/v1/models", timeout=30)
    assert refused.status_code == 401


def test_disable_uvicorn_access_log(config_server):
    assert httpx.get(f"{config_server.url}/v1/models", headers=bearer("c1"), timeout=30).status_code == 200
    log = config_server.process.log()
    assert "Started server process" in log  # uvicorn logs at info, but no line per request
    assert ACCESS_LINE not in log and '"GET /health HTTP/1.1"' not in log


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_config_file_values_by_flag_kind(tmp_path, tiny_model_dir):
    config = write(
        tmp_path / "c.yaml",
        (
            f"model: {tiny_model_dir}\nseed: 5\nmax-model-len: 64\nenable-prefix-caching: false\n"
            "served-model-name: [a, b]\napi-key: [c1, c2]\ntrust-remote-code: true\ndisable-log-requests: false\n"
            'override-generation-config: {"temperature": 0.5}\n'
        ),
    )
    args = build_parser().parse_args(["serve", "--config", config, "--max-model-len", "32", "--api-key", "k"])
    assert (args.model, args.model_tag, args.seed, args.max_model_len) == ([str(tiny_model_dir)], None, 5, 32)
    assert (args.enable_prefix_caching, args.trust_remote_code, args.enable_log_requests) == (False, True, False)
    assert (args.served_model_name, args.api_key) == ([["a", "b"]], ["k"])  # the command line's key only
    assert args.override_generation_config == '{"temperature": 0.5}'
    positional = build_parser().parse_args(["serve", "other-model", f"--config={config}"])
    assert (positional.model_tag, positional.model) == ("other-model", None)  # it replaces the file's model


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "max-modle-len: 64\n",
            "'max-modle-len' is not a flag of this command (keys are flag names without the "
            "leading --, as max-model-len)",
        ),
        ("grpc-port: 1\n", "'grpc-port' is not a flag of this command"),  # a serve flag, given to gateway
        ("allow-credentials: 3\n", "allow-credentials is a switch: give true or false, got 3"),
        ("port: [1, 2]\n", "port takes one value, got [1, 2]"),
        ("port:\n", "port has no value"),
        ("- port\n", "must be a YAML mapping of flag names to values, got list"),
    ],
)
def test_config_file_errors_name_the_file_and_the_key(tmp_path, capsys, text, message):
    config = write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit) as info:
        main(["gateway", "--engine", "a=127.0.0.1:1", "--config", config])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"raypaged gateway: error: --config {config}")
    assert message in last


def test_config_given_twice_is_refused(tmp_path, capsys):
    config = write(tmp_path / "c.yaml", "port: 8001\n")
    with pytest.raises(SystemExit):
        main(["gateway", "--engine", "a=127.0.0.1:1", "--config", config, "--config", config])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "raypaged gateway: error: --config is given 2 times; give one file"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--ssl-keyfile", "key.pem"],
            "error: --ssl-keyfile needs --ssl-certfile (the certificate to serve HTTPS with)",
        ),
        (["--root-path", "llm"], "error: --root-path must start with '/', got 'llm'"),
        (["--api-key", "k1", ""], "error: --api-key takes non-empty keys"),
    ],
)
def test_gateway_flag_errors(capsys, flags, message):
    assert main(["gateway", "--engine", "a=127.0.0.1:1", *flags]) == 2
    assert capsys.readouterr().err.strip() == message


def test_a_certificate_that_cannot_be_loaded_is_refused_before_serving(tmp_path, capsys, certificate):
    cert, _ = certificate
    not_a_key = write(tmp_path / "key.pem", "not a key\n")
    assert main(["gateway", "--engine", "a=127.0.0.1:1", "--ssl-certfile", str(cert), "--ssl-keyfile", not_a_key]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(f"error: --ssl-certfile {cert} with --ssl-keyfile {not_a_key}: not a usable certificate and key (")
    )


def test_max_num_partial_prefills_accepts_1_and_refuses_others(tiny_model_dir):
    [config] = engine_configs(
        build_parser().parse_args(["serve", str(tiny_model_dir), "--max-num-partial-prefills", "1", *ENGINE_FLAGS])
    )
    assert config.max_model_len == 128
    with pytest.raises(ValueError) as info:
        engine_configs(build_parser().parse_args(["serve", str(tiny_model_dir), "--max-num-partial-prefills", "2"]))
    assert str(info.value) == (
        "--max-num-partial-prefills 2 is not supported: prompts are chunked within the step's "
        "--max-num-batched-tokens and --long-prefill-token-threshold, with no other bound on how many are partly "
        "prefilled at once, as vLLM V1's scheduler; only its default 1 is taken"
    )


def test_the_scheduler_prefills_one_prompt_in_chunks_at_a_time():
    """Why only 1 is accepted: three 20-token prompts under an 8-token budget are cut one after another."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64), KVCacheManager(32, 4)
    )
    for request_id in "abc":
        params = SamplingParams(temperature=0, max_tokens=2)
        scheduler.add_request(Request(request_id, list(range(1, 21)), params, 2, 0))
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        done = {
            rid: SampledToken(7, -0.5, None)
            for rid, n in out.num_scheduled_tokens.items()
            if scheduler.requests[rid].num_computed_tokens + n == scheduler.requests[rid].num_tokens
        }
        scheduler.update_from_output(out, ModelRunnerOutput(sampled=done))
        steps.append(out.num_scheduled_tokens)
    # each step cuts at most its last prompt; the one behind it waits for the next step
    assert steps == [
        {"a": 8},
        {"a": 8},
        {"a": 4, "b": 4},
        {"a": 1, "b": 7},
        {"b": 8},
        {"b": 1, "c": 7},
        {"b": 1, "c": 7},
        {"c": 6},
        {"c": 1},
    ]
