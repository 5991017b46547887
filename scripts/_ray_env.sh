# Sourced by the cluster scripts. Ray (2.5x+) turns token authentication on for a head that finds a token
# (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), but a worker node or `ray job submit` only
# sends one when RAY_AUTH_MODE=token, so without this a node joining such a head fails with
# "InvalidAuthToken". Every node of a cluster needs the head's token (copy ~/.ray/auth_token, or export
# RAY_AUTH_TOKEN); RAY_AUTH_MODE set by hand wins.
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] ||
                                    [ -f "$HOME/.ray/auth_token" ]; }; then
  export RAY_AUTH_MODE=token
fi
