# Sourced by the 30B launch scripts: `ray_cli` sets RAY, the `ray` to submit with (PATH's, else the
# project's venv: a user need not activate it), and checks that a cluster answers at RAY_DASHBOARD.
# Either failing is one line saying what to do, not `command not found` or Ray's 15-line traceback.
ray_cli() {
  local venv="${VENV:-$PWD/.venv}"
  if command -v ray >/dev/null 2>&1; then
    RAY=ray
  elif [ -x "$venv/bin/ray" ]; then
    RAY="$venv/bin/ray"
  else
    echo "error: no \`ray\` on PATH nor in $venv/bin: run \`bash launch/setup_env.sh\`, or set VENV to the" \
      "environment dapo-megatron is installed in" >&2
    exit 2
  fi
  local hostport="${RAY_DASHBOARD#*://}"
  hostport="${hostport%%/*}"
  local host="${hostport%:*}" port="${hostport##*:}"
  [ "$host" != "$hostport" ] || port=8265  # Ray's dashboard port when the address names none
  if ! timeout 5 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null; then
    echo "error: no Ray cluster answers at RAY_DASHBOARD=$RAY_DASHBOARD: start one (\`ray start --head\` on" \
      "this node, \`ray start --address=HEAD_IP:6379\` on the others) or set RAY_DASHBOARD to its dashboard" >&2
    exit 2
  fi
}
