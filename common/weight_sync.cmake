# Weight sync (common/weight_sync.h), included from common/CMakeLists.txt.
#   grpo_weight_sync: the protocol, the in-process fake and the Gloo backend (libtorch's c10d;
#                     libtorch exports the Gloo it was built with but does not ship its headers:
#                     ProcessGroupGloo.hpp compiles against Debian's libgloo-dev, which predates
#                     GLOO_STORE_HAS_STORE_V2, and every gloo type it names in the layout of a
#                     class we allocate is behind a smart pointer, so the object layout is
#                     libtorch's own. We never construct a gloo object ourselves.)
#   grpo_nccl_sync:   the NCCL backend; built only where CUDA's runtime and NCCL are found
#                     (/usr/local/cuda here). Needs no CUDA libtorch.

option(GRPO_WITH_GLOO "Build the Gloo weight-sync backend (needs libgloo-dev)" ON)
option(GRPO_WITH_NCCL "Build the NCCL weight-sync backend when CUDA and NCCL are found" ON)

add_library(grpo_weight_sync STATIC
  weight_sync_protocol.cc
  fake_weight_sync.cc
  gloo_weight_sync.cc
)
target_link_libraries(grpo_weight_sync PUBLIC grpo_common_base torch)

if(GRPO_WITH_GLOO)
  find_path(GRPO_GLOO_INCLUDE_DIR gloo/context.h)
  if(NOT GRPO_GLOO_INCLUDE_DIR AND NOT GRPO_BUILD_SERVICES)
    # The libtorch-only build (GPU machines without libgloo-dev): the fake and NCCL only.
    message(STATUS "Gloo weight sync: not built (no gloo/context.h; GRPO_BUILD_SERVICES=OFF)")
    set(GRPO_WITH_GLOO OFF)
  elseif(NOT GRPO_GLOO_INCLUDE_DIR)
    message(FATAL_ERROR "Gloo headers not found: apt-get install libgloo-dev "
                        "(deploy/setup.sh), or configure with -DGRPO_WITH_GLOO=OFF")
  endif()
endif()
if(GRPO_WITH_GLOO)
  set_property(GLOBAL PROPERTY GRPO_GLOO_BUILT ON)  # tests/CMakeLists.txt registers its tests
  # ProcessGroupGloo.hpp is guarded by USE_C10D_GLOO (libtorch was built with it).
  target_compile_definitions(grpo_weight_sync PRIVATE USE_C10D_GLOO GRPO_HAVE_GLOO)
  target_include_directories(grpo_weight_sync SYSTEM PRIVATE ${GRPO_GLOO_INCLUDE_DIR})
  # Only the headers: libtorch itself exports the Gloo it was built with; linking Debian's
  # libgloo too would give two copies of every gloo symbol.
endif()

if(GRPO_WITH_NCCL)
  find_package(CUDAToolkit QUIET)
  find_path(GRPO_NCCL_INCLUDE_DIR nccl.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(GRPO_NCCL_LIBRARY nccl
    HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  if(CUDAToolkit_FOUND AND TARGET CUDA::cudart AND GRPO_NCCL_INCLUDE_DIR AND GRPO_NCCL_LIBRARY)
    message(STATUS "NCCL weight sync: ${GRPO_NCCL_LIBRARY} (CUDA ${CUDAToolkit_VERSION})")
    add_library(grpo_nccl_sync STATIC nccl_weight_sync.cc)
    target_include_directories(grpo_nccl_sync SYSTEM PRIVATE ${GRPO_NCCL_INCLUDE_DIR})
    # cudart is public: GPU callers and tests allocate device memory themselves.
    target_link_libraries(grpo_nccl_sync PUBLIC grpo_weight_sync CUDA::cudart
      PRIVATE ${GRPO_NCCL_LIBRARY})
  else()
    message(STATUS "NCCL weight sync: not built (CUDA runtime or NCCL not found)")
  endif()
endif()
