"""tools/ncu_roles.py: the split of an ncu source-page export by role (no GPU: synthetic rows)."""

from tools.ncu_roles import split_roles


def test_ncu_roles_numbers_a_second_producer_branch():
    """tools/ncu_roles.py splits an ncu source export by the roles' setmaxnreg markers; fp8_mma's copier and
    transposer are two producer branches and must not be summed into one."""
    source = ["MOV R1, c[0x0][0x28]", "USETMAXREG.TRY_ALLOC.CTAPOOL 0xf0", "QGMMA.64x16x32", "USETMAXREG.DEALLOC 0x80",
              "LDGSTS.E.BYPASS.128", "USETMAXREG.DEALLOC 0x80", "PRMT R1, R2, R3, R4", "LDS R5, [R6]"]
    roles = split_roles([{"Source": s} for s in source])
    assert {k: len(v) for k, v in roles.items()} == {"common": 1, "consumer": 2, "producers": 2, "producers 2": 3}
