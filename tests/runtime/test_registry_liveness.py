"""An actor that has closed its connections but whose process is still exiting is reported
`disconnected` (lookups skip it), not dead by heartbeat: the node daemon must not kill it."""

RECIPE = '''
[run]
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
heartbeat_interval_s = 0.5
liveness_timeout_s = 4.0
[actors.driver]
class = "slow_exit_actors:SlowExitDriver"
main = true
'''


def test_a_slowly_exiting_main_actor_ends_the_job_with_its_own_code(node_launcher):
    (daemon,), _, logs = node_launcher(RECIPE)
    assert daemon.wait(60) == 0, logs[0].read_text()
    assert "killing it" not in logs[0].read_text()
