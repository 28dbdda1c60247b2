import os

# The suite forks command-line clients and services from a process that uses gRPC. With gRPC's
# fork support on, its poller thread restarts in the child between fork and exec, and once
# close_fds has closed its epoll descriptor it may print "epoll_wait error: Bad file descriptor"
# on the child's stderr (grpc/grpc#43157): about one run in ten of a test that checks a client's
# stderr. Nothing here uses gRPC in a forked child, so the fork handlers are not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
