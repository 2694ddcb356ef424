from raypaged.serving.protogen import STUB_DIR, generate_stubs


def test_checked_in_stubs_match_the_protos():
    generated = generate_stubs()
    assert sorted(generated) == ["generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py"]
    for name, text in generated.items():
        assert (STUB_DIR / name).read_text() == text, f"{name} is stale: run `make protos`"
