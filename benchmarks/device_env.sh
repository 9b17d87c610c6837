# Source this first in a command on the bare GPU machine (no network there):
#   source benchmarks/device_env.sh
# It makes the `dejavu` namespace importable without installing, by linking the design-card
# folders (models/, compiler/, runtime/, plugins/) into the checkout's `dejavu/` folder
# (those links are git-ignored). Run from the repository root.
export PYTHONUNBUFFERED=1
pip uninstall -y -q dejavu >/dev/null 2>&1 || true  # an editable install would shadow the links
for p in models compiler runtime plugins; do ln -sfn "../$p" "dejavu/$p"; done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import dejavu.models, torch; print('dejavu from', dejavu.__file__, '| torch', torch.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
