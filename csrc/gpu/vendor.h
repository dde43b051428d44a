// Maps the project's gpu* names onto CUDA or HIP. Included only by the
// implementation files of csrc/gpu, never by a header others include.
#pragma once

#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#include <hip/hip_runtime.h>
#define MORI_HIP 1
#define gpuError_t hipError_t
#define gpuSuccess hipSuccess
#define gpuErrorNotReady hipErrorNotReady
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuSetDevice hipSetDevice
#define gpuDeviceEnablePeerAccess hipDeviceEnablePeerAccess
#define gpuErrorPeerAccessAlreadyEnabled hipErrorPeerAccessAlreadyEnabled
#define gpuGetDevice hipGetDevice
#define gpuPointerAttributes hipPointerAttribute_t
#define gpuPointerGetAttributes hipPointerGetAttributes
#if HIP_VERSION_MAJOR >= 6
#define gpuPointerIsDevice(attr) ((attr).type == hipMemoryTypeDevice)
#else
#define gpuPointerIsDevice(attr) ((attr).memoryType == hipMemoryTypeDevice)
#endif
#define gpuDeviceGetPCIBusId hipDeviceGetPCIBusId
#define gpuIpcMemHandle_t hipIpcMemHandle_t
#define gpuIpcGetMemHandle hipIpcGetMemHandle
#define gpuIpcOpenMemHandle hipIpcOpenMemHandle
#define gpuIpcCloseMemHandle hipIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define gpuStream_t hipStream_t
#define gpuStreamCreateWithFlags hipStreamCreateWithFlags
#define gpuStreamNonBlocking hipStreamNonBlocking
#define gpuStreamDestroy hipStreamDestroy
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuEvent_t hipEvent_t
#define gpuEventCreateWithFlags hipEventCreateWithFlags
#define gpuEventDisableTiming hipEventDisableTiming
#define gpuEventDestroy hipEventDestroy
#define gpuEventRecord hipEventRecord
#define gpuEventQuery hipEventQuery
#define gpuEventSynchronize hipEventSynchronize
#define gpuStreamCaptureMode hipStreamCaptureMode
#define gpuStreamCaptureModeRelaxed hipStreamCaptureModeRelaxed
#define gpuThreadExchangeStreamCaptureMode hipThreadExchangeStreamCaptureMode
#define gpuStreamWaitEvent hipStreamWaitEvent
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyDefault hipMemcpyDefault
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuHostRegister hipHostRegister
#define gpuHostUnregister hipHostUnregister
#define gpuHostGetDevicePointer hipHostGetDevicePointer
#define gpuHostRegisterPortable hipHostRegisterPortable
#define gpuHostRegisterMapped hipHostRegisterMapped
#define gpuMemGetAddressRange(base, size, ptr) hipMemGetAddressRange(base, size, ptr)
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#else
#include <cuda_runtime.h>
#define MORI_HIP 0
#define gpuError_t cudaError_t
#define gpuSuccess cudaSuccess
#define gpuErrorNotReady cudaErrorNotReady
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuSetDevice cudaSetDevice
#define gpuDeviceEnablePeerAccess cudaDeviceEnablePeerAccess
#define gpuErrorPeerAccessAlreadyEnabled cudaErrorPeerAccessAlreadyEnabled
#define gpuGetDevice cudaGetDevice
#define gpuPointerAttributes cudaPointerAttributes
#define gpuPointerGetAttributes cudaPointerGetAttributes
#define gpuPointerIsDevice(attr) ((attr).type == cudaMemoryTypeDevice)
#define gpuDeviceGetPCIBusId cudaDeviceGetPCIBusId
#define gpuIpcMemHandle_t cudaIpcMemHandle_t
#define gpuIpcGetMemHandle cudaIpcGetMemHandle
#define gpuIpcOpenMemHandle cudaIpcOpenMemHandle
#define gpuIpcCloseMemHandle cudaIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define gpuStream_t cudaStream_t
#define gpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define gpuStreamNonBlocking cudaStreamNonBlocking
#define gpuStreamDestroy cudaStreamDestroy
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuEvent_t cudaEvent_t
#define gpuEventCreateWithFlags cudaEventCreateWithFlags
#define gpuEventDisableTiming cudaEventDisableTiming
#define gpuEventDestroy cudaEventDestroy
#define gpuEventRecord cudaEventRecord
#define gpuEventQuery cudaEventQuery
#define gpuEventSynchronize cudaEventSynchronize
#define gpuStreamCaptureMode cudaStreamCaptureMode
#define gpuStreamCaptureModeRelaxed cudaStreamCaptureModeRelaxed
#define gpuThreadExchangeStreamCaptureMode cudaThreadExchangeStreamCaptureMode
#define gpuStreamWaitEvent cudaStreamWaitEvent
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyDefault cudaMemcpyDefault
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuHostRegister cudaHostRegister
#define gpuHostUnregister cudaHostUnregister
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuHostRegisterPortable cudaHostRegisterPortable
#define gpuHostRegisterMapped cudaHostRegisterMapped
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#endif

// Graph user objects: a destructor callback whose reference a CUDA/HIP graph
// owns (CUDA 11.3+; HIP 6.0+, HIP 5.2 has none). MORI_GPU_USER_OBJECTS says
// whether this toolkit has them; gpuStreamGetCaptureGraph(stream, &status,
// &graph) gives the graph a stream is capturing into.
#if MORI_HIP
#if defined(HIP_VERSION) && HIP_VERSION >= 60000000
#define MORI_GPU_USER_OBJECTS 1
#else
#define MORI_GPU_USER_OBJECTS 0
#endif
#define gpuGraph_t hipGraph_t
#define gpuStreamCaptureStatus hipStreamCaptureStatus
#define gpuStreamCaptureStatusActive hipStreamCaptureStatusActive
#define gpuStreamGetCaptureGraph(s, status, graph) hipStreamGetCaptureInfo_v2(s, status, nullptr, graph)
#if MORI_GPU_USER_OBJECTS
#define gpuUserObject_t hipUserObject_t
#define gpuUserObjectCreate hipUserObjectCreate
#define gpuUserObjectNoDestructorSync hipUserObjectNoDestructorSync
#define gpuGraphRetainUserObject hipGraphRetainUserObject
#define gpuGraphUserObjectMove hipGraphUserObjectMove
#define gpuUserObjectRelease hipUserObjectRelease
#endif
#else
#if CUDART_VERSION >= 11030
#define MORI_GPU_USER_OBJECTS 1
#else
#define MORI_GPU_USER_OBJECTS 0
#endif
#define gpuGraph_t cudaGraph_t
#define gpuStreamCaptureStatus cudaStreamCaptureStatus
#define gpuStreamCaptureStatusActive cudaStreamCaptureStatusActive
#if CUDART_VERSION >= 12000
// CUDA 12 renamed _v2 to the plain name; CUDA 13 added edge data after the
// graph (defaulted, like the rest).
#define gpuStreamGetCaptureGraph(s, status, graph) cudaStreamGetCaptureInfo(s, status, nullptr, graph)
#else
#define gpuStreamGetCaptureGraph(s, status, graph) cudaStreamGetCaptureInfo_v2(s, status, nullptr, graph)
#endif
#if MORI_GPU_USER_OBJECTS
#define gpuUserObject_t cudaUserObject_t
#define gpuUserObjectCreate cudaUserObjectCreate
#define gpuUserObjectNoDestructorSync cudaUserObjectNoDestructorSync
#define gpuGraphRetainUserObject cudaGraphRetainUserObject
#define gpuGraphUserObjectMove cudaGraphUserObjectMove
#define gpuUserObjectRelease cudaUserObjectRelease
#endif
#endif
