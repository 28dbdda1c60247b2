"""The web console: what the three services hold, in a browser (trials with their reward curves
and samples, models and their versions, the directory), read through their public gRPC APIs."""
