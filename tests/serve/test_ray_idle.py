"""The Ray timer settings ``tetris serve`` starts Ray with (tetris/serve/ray_idle.py)."""

from tetris.serve import ray_idle


def test_apply_sets_only_what_is_unset_and_the_switch_keeps_rays_defaults():
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2", "PATH": "/bin"}
    added = ray_idle.apply(env)
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"       # the caller's value wins
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in added
    assert set(added) == set(ray_idle.RAY_IDLE_ENV_VARS) - {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S"}
    assert all(env[k] == ray_idle.RAY_IDLE_ENV_VARS[k] for k in added)

    defaults = {ray_idle.DEFAULTS_SWITCH: "1"}
    assert ray_idle.apply(defaults) == {}
    assert defaults == {ray_idle.DEFAULTS_SWITCH: "1"}

