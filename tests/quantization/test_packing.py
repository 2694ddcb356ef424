"""Sub-byte packing: round trips, and compressed-tensors' own packer writes the same words."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from raypaged.quantization.packing import AWQ_ORDER, pack, unpack


@pytest.mark.parametrize(
    "bits, dim, order", [(4, 0, None), (4, 1, None), (8, 0, None), (8, 1, None), (4, 0, AWQ_ORDER), (4, 1, AWQ_ORDER)]
)
def test_unpack_inverts_pack(bits, dim, order):
    values = torch.randint(0, 1 << bits, (16, 24), generator=torch.Generator().manual_seed(bits + dim))
    assert torch.equal(unpack(pack(values, bits, dim, order), bits, dim, order), values.to(torch.int32))


def test_awq_order_puts_column_j_at_nibble_of_its_order_index():
    values = torch.arange(8).reshape(1, 8)  # columns 0..7 hold their own index
    word = int(pack(values, 4, 1, AWQ_ORDER)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_ORDER)


@pytest.mark.parametrize("dim", [0, 1])
def test_packing_matches_compressed_tensors(dim):
    signed = torch.randint(-8, 8, (16, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(dim))
    words = pack(signed.to(torch.int32) + 8, 4, dim)
    assert torch.equal(words, pack_to_int32(signed, 4, packed_dim=dim))
    assert torch.equal(unpack(words, 4, dim) - 8, unpack_from_int32(words, 4, signed.shape, packed_dim=dim).int())
