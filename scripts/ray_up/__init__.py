"""`python -m scripts.ray_up_check`'s parts: the preflight refusal (`preflight`), the copies of
deploy/ray/cluster-local.yaml and serve.yaml with the fields a user edits (`configs`), the hosts
in network, PID and mount namespaces with their own sshd (`hosts`), and the phase clock and
command runner (`phases`)."""
