"""What the client and the daemon share: wire models, manifests, command-line parts."""
