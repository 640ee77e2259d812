"""`python -m tracegen.simulator`: start the SGLang stand-in (flags of `python -m sglang.launch_server`)."""

from tracegen.simulator.http_server import main

if __name__ == "__main__":
    main()
