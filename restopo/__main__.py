from .cli import main
from .worker import leave

code = main()
leave(code)  # a torchrun worker exits here, past torch's teardown
raise SystemExit(code)
