"""Device backends (the DCMI driver, or a simulated node) and the monitor that polls and listens to them."""
