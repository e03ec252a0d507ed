"""Routes made once per set of peers and handed to the planner: the same plan as without
them, and refused when made for other engine records."""
import dataclasses

import pytest

from kvcopy.nixl.planning.routes import plan_routes
from kvcopy.nixl.planning.plan import build_multi_pull_plan
from kvcopy.nixl.engine.info import pair_layers
from kvcopy.testing.nixl.engines import build_case, engine_info

NP = 40


@pytest.fixture
def engines():
    d, p = engine_info(build_case("hybrid", NP), "D"), engine_info(build_case("hybrid", NP), "P")
    return d, [(p, pair_layers(d, p))]


def test_the_same_plan_with_routes_made_once(engines):
    d, sources = engines
    routes = plan_routes(d, sources)
    args = ([[1, 2, 3], [8, 9, 10, 11, 12]], 70, [[4, 5, 6], [0, 1, 2, 3, 14]], 16)
    fresh = build_multi_pull_plan(d, sources, *args)
    again = [build_multi_pull_plan(d, sources, *args, routes=routes) for _ in range(2)]
    assert fresh == again[0] == again[1] and not fresh.empty
    # the routes serve every local layer once per head range, in plan order
    assert sorted(n for r in routes.routes for n in r.layers) == sorted(d.layers())


def test_routes_for_other_records_are_refused(engines):
    d, sources = engines
    routes = plan_routes(d, sources)
    other = engine_info(build_case("hybrid", NP), "P2")
    args = ([[1, 2, 3], [8, 9, 10, 11, 12]], 70, [[4, 5, 6], [0, 1, 2, 3, 14]])
    with pytest.raises(ValueError, match="routes made for other engine records"):
        build_multi_pull_plan(d, [(other, pair_layers(d, other))], {"P2": args[0]}, *args[1:], routes=routes)
    with pytest.raises(ValueError, match="routes made for other engine records"):
        build_multi_pull_plan(dataclasses.replace(d, name="D2"), sources, *args, routes=routes)
    # an equal record that is another object: the routes fit it (compared by value)
    twin = dataclasses.replace(d)
    assert build_multi_pull_plan(twin, sources, *args, routes=routes) == build_multi_pull_plan(d, sources, *args)


def test_a_layer_on_no_peer_is_refused_when_the_routes_are_made():
    d = engine_info(build_case("hybrid", NP), "D")
    p = engine_info(build_case("one_group", NP), "P")
    with pytest.raises(ValueError, match="on none of the peers"):
        plan_routes(d, [(p, [])])
