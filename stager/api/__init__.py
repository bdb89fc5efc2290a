"""The daemon's face: HTTP routes, the app, its server and connections, start-up, logs."""
