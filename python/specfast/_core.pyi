"""Type stubs for the compiled core, `specfast._core`."""
