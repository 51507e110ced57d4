"""3D-cube-major token order: a bijection that round-trips, with the right coordinates."""

import pytest
import torch

from megatron_dsv.attention.grouping import (cube_order_coords, cube_order_permutation, from_cube_order,
                                             to_cube_order)

GRIDS = [pytest.param((4, 8, 8), (2, 4, 4), id="T4-H8-W8-cube2x4x4"),
         pytest.param((8, 8, 8), (4, 4, 4), id="T8-H8-W8-cube4x4x4"),
         pytest.param((3, 5, 7), (2, 4, 4), id="T3-H5-W7-partial")]


@pytest.mark.parametrize("grid,cube", GRIDS)
def test_permutation_is_bijection(grid, cube):
    perm = cube_order_permutation(grid, cube)
    n = grid[0] * grid[1] * grid[2]
    assert perm.shape == (n,)
    assert torch.equal(perm.sort().values, torch.arange(n))


@pytest.mark.parametrize("grid,cube", GRIDS)
def test_round_trip(grid, cube):
    n = grid[0] * grid[1] * grid[2]
    x = torch.randn(2, n, 3)
    y = to_cube_order(x, grid, cube, dim=1)
    assert not torch.equal(x, y)
    assert torch.equal(from_cube_order(y, grid, cube, dim=1), x)
    assert torch.equal(to_cube_order(from_cube_order(x, grid, cube, dim=1), grid, cube, dim=1), x)


@pytest.mark.parametrize("grid,cube", GRIDS[:2])
def test_groups_are_cubes_and_coords_match(grid, cube):
    T, H, W = grid
    coords = cube_order_coords(grid, cube)
    raster = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij"), -1)
    # the coordinates are those of the reordered raster tokens
    assert torch.equal(coords, to_cube_order(raster.reshape(-1, 3), grid, cube, dim=0))
    G = cube[0] * cube[1] * cube[2]
    for g in range(coords.shape[0] // G):
        c = coords[g * G:(g + 1) * G]
        span = c.max(0).values - c.min(0).values + 1
        assert span.tolist() == list(cube), f"group {g} is not a {cube} cube: {c.tolist()}"
        assert (c.min(0).values % torch.tensor(cube) == 0).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="grid"):
        cube_order_permutation((4, 8), (2, 4, 4))
    with pytest.raises(ValueError, match="cube"):
        cube_order_permutation((4, 8, 8), (0, 4, 4))
    with pytest.raises(ValueError, match="T\\*H\\*W"):
        to_cube_order(torch.randn(10, 2), (4, 8, 8), (2, 4, 4))
