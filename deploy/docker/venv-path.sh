# Login shells (Ray's launcher and KubeRay run `bash -l`) find tpserve's venv first, whatever
# the distribution's profile does to PATH.
case ":${PATH}:" in
    *:/opt/venv/bin:*) ;;
    *) export PATH="/opt/venv/bin:${PATH}" ;;
esac
