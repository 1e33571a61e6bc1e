"""What the machine gives this server: the cores (`cpus`) and the memory (`memory`) it may use, read from the
cgroup a container is held in, else from the host itself."""
