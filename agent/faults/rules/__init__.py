"""The pure rules core: fault levels, the device plugin's code tables and customization, and the engine that applies them."""
