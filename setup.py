"""Only the native extension lives here; everything else is in pyproject.toml.

agent._native is optional: if it cannot be built (no C compiler, no Python headers) the install
still succeeds and agent.worker falls back to its pure-Python collector."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "agent._native",
            ["native/mspti_buffer.c"],
            depends=["native/mspti_abi.h"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11", "-fvisibility=hidden"],
            libraries=["dl"],
        )
    ]
)
