/* What neuron-sys binds: the Neuron runtime's public headers. With the SDK installed they are found
 * under /opt/aws/neuron/include (or NEURON_SDK_INCLUDE); build.rs (feature `bindgen`) lets bindgen
 * keep only the functions and types listed there. */
#include <nrt/nrt.h>
#include <nrt/nrt_version.h>
